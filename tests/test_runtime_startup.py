"""H7's start-up check on its own; the e2e tests show a real server refusing to start."""

from __future__ import annotations

import logging

import pytest

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
