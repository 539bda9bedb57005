"""H7's start-up check on its own; the e2e tests show a real server refusing to start."""

from __future__ import annotations

import json
import logging
import re
import types
from collections import OrderedDict

import pytest

from sglang_hardened.common.knobs import ALLOW_EARLY_RELEASE, ALLOW_TOKENIZER_WORKERS, ALLOW_UNSAFE_KV_LIMITS
from sglang_hardened.runtime import startup
from sglang_hardened.runtime.startup import UnsafeConfiguration, check_kv_pool


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch):
    """Each test starts with a decode that has logged nothing about any prefill."""
    monkeypatch.setattr(startup, "_said", OrderedDict())


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_server_with_pool_below_context_is_refused_with_both_numbers(mode, monkeypatch):
    monkeypatch.delenv(ALLOW_UNSAFE_KV_LIMITS.name, raising=False)
    with pytest.raises(UnsafeConfiguration, match=rf"{mode} server's KV pool holds 256 tokens.*context length 1024"):
        check_kv_pool(mode, 256, 1024)


def test_pool_that_holds_a_full_context_and_non_pd_servers_pass(monkeypatch):
    monkeypatch.delenv(ALLOW_UNSAFE_KV_LIMITS.name, raising=False)
    check_kv_pool("prefill", 1024, 1024)
    check_kv_pool("null", 256, 1024)


def test_override_starts_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_UNSAFE_KV_LIMITS.name, "1")
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        check_kv_pool("decode", 256, 1024)
    assert f"{ALLOW_UNSAFE_KV_LIMITS.name}=1 overrides this check" in caplog.text


@pytest.fixture
def bootstrap_server(http_stand_in):
    """A prefill's bootstrap server stand-in: ``answers`` maps a path to its JSON (else 404)."""
    answers: dict[str, object] = {}

    def answer(path: str) -> tuple[int, bytes]:
        return (404, b"") if path not in answers else (200, json.dumps(answers[path]).encode())

    return http_stand_in(answer), answers


def test_decode_refuses_a_prefill_with_a_lower_input_limit(bootstrap_server, monkeypatch, caplog):
    addr, answers = bootstrap_server
    monkeypatch.delenv(ALLOW_UNSAFE_KV_LIMITS.name, raising=False)
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 250}
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert startup.check_prefill_limits(addr) is False
        assert startup.check_prefill_limits(addr) is False  # retried each cycle, logged once
    assert re.findall(r"up to 1018 tokens but the prefill at .* only up to 250", caplog.text) != []
    assert caplog.text.count("only up to 250") == 1
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 1018}
    assert startup.check_prefill_limits(addr) is True


# Finding: on main each of these raised out of check_prefill_limits, which runs in
# decode's scheduler loop, and SGLang shut decode down.
BAD_REPLIES = {
    "not JSON": b"<html>proxy error</html>",
    "not an object": b"[1018]",
    "a string limit": b'{"max_req_input_len": "1018"}',
    "a negative limit": b'{"max_req_input_len": -1}',
    "a boolean limit": b'{"max_req_input_len": true}',
    "too deep": b"[" * 100_000,
    "too long": b'{"pad": "' + b"x" * 10_000 + b'"}',
}


@pytest.mark.parametrize("case", [*BAD_REPLIES, "refused connection"])
def test_a_prefill_whose_limit_cannot_be_read_is_not_ready_and_nothing_raises(case, http_stand_in, monkeypatch,
                                                                              caplog):
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    addr = "127.0.0.1:1" if case == "refused connection" else http_stand_in(lambda _: (200, BAD_REPLIES[case]))
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert startup.check_prefill_limits(addr) is False
    assert f"cannot read the input limit of the prefill at {addr}" in caplog.text


def test_an_unhardened_prefill_is_logged_not_refused(bootstrap_server, monkeypatch, caplog):
    addr, _ = bootstrap_server
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert startup.check_prefill_limits(addr) is True
    assert f"prefill at {addr} is not hardened" in caplog.text


def test_bootstrap_server_serves_the_smallest_limit_its_ranks_hold_now(monkeypatch):
    monkeypatch.setattr(startup, "_rank_limits", {})
    for rank, value in (((0, 0, 0, 0), 1018), ((0, 0, 1, 0), 250), ((0, 0, 2, 0), 600)):
        startup.note_registration(rank, {startup.REGISTRATION_FIELD: value, "page_size": 1})
    startup.note_registration((0, 0, 3, 0), {"page_size": 1})  # an upstream rank registers no limit
    assert startup.registered_limit() == 250
    # Finding: on main one PUT /route with limit 1 pinned the served limit for ever.
    startup.note_registration((0, 0, 1, 0), {startup.REGISTRATION_FIELD: 1})
    assert startup.registered_limit() == 1
    startup.note_registration((0, 0, 1, 0), {startup.REGISTRATION_FIELD: 1018})  # the rank registers again
    assert startup.registered_limit() == 600


@pytest.mark.parametrize("value", ["1", -5, 0, True, 1 << 40, [1], None])
def test_a_registration_without_a_valid_limit_leaves_the_rank_without_one(value, monkeypatch):
    monkeypatch.setattr(startup, "_rank_limits", {(0, 0, 0, 0): 1018})
    startup.note_registration((0, 0, 1, 0), {startup.REGISTRATION_FIELD: 250})
    startup.note_registration((0, 0, 1, 0), {startup.REGISTRATION_FIELD: value})
    assert startup.registered_limit() == 1018


def test_rank_limits_are_bounded(monkeypatch):
    monkeypatch.setattr(startup, "_rank_limits", {})
    monkeypatch.setattr(startup, "RANKS_MAX", 2)
    for tp in range(3):
        startup.note_registration((0, 0, tp, 0), {startup.REGISTRATION_FIELD: 500 - tp})
    assert startup.registered_limit() == 499 and len(startup._rank_limits) == 2


def test_override_lets_decode_serve_a_prefill_with_a_lower_limit(bootstrap_server, monkeypatch, caplog):
    addr, answers = bootstrap_server
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    monkeypatch.setenv(ALLOW_UNSAFE_KV_LIMITS.name, "1")
    answers[startup.LIMITS_ROUTE] = {"max_req_input_len": 250}
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert startup.check_prefill_limits(addr) is True
    assert "Serving anyway" in caplog.text


@pytest.mark.parametrize("value", ["0", "false", "No"])
def test_a_pd_server_with_deferred_release_off_is_refused(value, monkeypatch):
    """Review finding: SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0 turned H5 off with a log line."""
    monkeypatch.setenv(startup.DEFERRED_ENV, value)
    monkeypatch.delenv(ALLOW_EARLY_RELEASE.name, raising=False)
    with pytest.raises(UnsafeConfiguration, match=rf"H5: {startup.DEFERRED_ENV}={value} turns deferred"):
        startup.check_release_setting("decode")
    startup.check_release_setting("null")  # not a PD server: nothing to hold


def test_deferred_release_override_starts_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(startup.DEFERRED_ENV, "0")
    monkeypatch.setenv(ALLOW_EARLY_RELEASE.name, "1")
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        startup.check_release_setting("prefill")
    assert f"{ALLOW_EARLY_RELEASE.name}=1 overrides this check" in caplog.text
    assert startup.deferred_release_on({}) and startup.deferred_release_on({startup.DEFERRED_ENV: "1"})


def test_a_prefill_with_tokenizer_workers_is_refused_unless_overridden(monkeypatch, caplog):
    """Review finding: H4's notes of the requests a tokenizer worker ends were never served."""
    monkeypatch.delenv(ALLOW_TOKENIZER_WORKERS.name, raising=False)
    args = types.SimpleNamespace(disaggregation_mode="prefill", tokenizer_worker_num=2)
    with pytest.raises(UnsafeConfiguration, match="H4: this prefill server has --tokenizer-worker-num 2"):
        startup.check_launch(args)
    for fine in ({"tokenizer_worker_num": 1}, {"disaggregation_mode": "decode"}, {"disaggregation_mode": "null"}):
        startup.check_launch(types.SimpleNamespace(**{**vars(args), **fine}))
    monkeypatch.setenv(ALLOW_TOKENIZER_WORKERS.name, "1")
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        startup.check_launch(args)
    assert f"{ALLOW_TOKENIZER_WORKERS.name}=1 overrides this check" in caplog.text
