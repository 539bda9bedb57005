"""H7's start-up check on its own; the e2e tests show a real server refusing to start."""

from __future__ import annotations

import logging

import pytest

from sglang_hardened.runtime import startup
from sglang_hardened.runtime.startup import OVERRIDE_ENV, UnsafeConfiguration, check_kv_pool


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_server_with_pool_below_context_is_refused_with_both_numbers(mode, monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    with pytest.raises(UnsafeConfiguration, match=rf"{mode} server's KV pool holds 256 tokens.*context length 1024"):
        check_kv_pool(mode, 256, 1024)


def test_pool_that_holds_a_full_context_and_non_pd_servers_pass(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    check_kv_pool("prefill", 1024, 1024)
    check_kv_pool("null", 256, 1024)


def test_override_starts_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        check_kv_pool("decode", 256, 1024)
    assert f"{OVERRIDE_ENV}=1 overrides this check" in caplog.text


@pytest.fixture
def bootstrap_server():
    """A real HTTP server on loopback answering the limits route like a prefill's bootstrap server."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers: dict[str, object] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = answers.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            if body is not None:
                self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()


def test_decode_refuses_a_prefill_with_a_lower_input_limit(bootstrap_server, monkeypatch):
    addr, answers = bootstrap_server
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 250}
    with pytest.raises(UnsafeConfiguration, match=r"up to 1018 tokens but the prefill at .* only up to 250"):
        startup.check_prefill_limits(addr)
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 1018}
    startup.check_prefill_limits(addr)


def test_an_unhardened_prefill_is_logged_not_refused(bootstrap_server, monkeypatch, caplog):
    addr, _ = bootstrap_server
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        startup.check_prefill_limits(addr)
    assert f"prefill at {addr} is not hardened" in caplog.text


def test_bootstrap_server_keeps_the_smallest_registered_limit(monkeypatch):
    monkeypatch.setattr(startup, "_registered_input_limit", None)
    for value in (1018, 250, 600):
        startup.note_registration({startup.REGISTRATION_FIELD: value, "page_size": 1})
    startup.note_registration({"page_size": 1})  # an upstream rank registers no limit
    assert startup._registered_input_limit == 250


def test_override_lets_decode_serve_a_prefill_with_a_lower_limit(bootstrap_server, monkeypatch, caplog):
    addr, answers = bootstrap_server
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 250}
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        startup.check_prefill_limits(addr)
    assert "Serving anyway" in caplog.text
