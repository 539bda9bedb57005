"""Bad input to the harness fails fast with a clear message, never a hang."""

from __future__ import annotations

import socket
import time

import pytest

from sglang_hardened.sandbox import cluster as sbc
from sglang_hardened.sandbox.env import SandboxError, build_env, upstream_wheel

from .conftest import OVERLAY, sandbox_env

pytestmark = pytest.mark.e2e
BASE = "0.5.23"


def test_unknown_base_is_named():
    with pytest.raises(SandboxError, match="unknown base '9.9.9'"):
        upstream_wheel("9.9.9")
    with pytest.raises(SandboxError, match="unknown base '9.9.9'"):
        build_env("9.9.9", [OVERLAY / "edits.toml"], OVERLAY)
    with pytest.raises(SandboxError, match="unknown base '9.9.9'"):
        sbc.ClusterParams(base="9.9.9").validate()


def test_port_in_use_is_refused_before_start(tmp_path):
    env = sandbox_env(BASE)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SandboxError, match=f"port {port} .* in use"):
            sbc.start(env, sbc.ClusterParams(base=BASE, decode_port=port), tmp_path)
    assert not sbc.marked_pids()


def _start_fails(env, params, model, match: str, deadline_s: float = 180) -> None:
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match=match) as err:
        sbc.start(env, params, model, deadline_s=deadline_s)
    assert time.monotonic() - t0 < deadline_s + 30
    assert "log tail" in str(err.value)
    assert not sbc.marked_pids()


def test_server_crashing_at_startup_reports_log_tail():
    env = sandbox_env(BASE)
    from sglang_hardened.sandbox.model import ensure_model

    params = sbc.ClusterParams(base=BASE, extra_flags=("--attention-backend", "no-such-backend"))
    _start_fails(env, params, ensure_model(env), "exited during start-up(?s:.*)no-such-backend")


def test_missing_model_dir_reports_log_tail(tmp_path):
    missing = tmp_path / "no-model-here"
    _start_fails(sandbox_env(BASE), sbc.ClusterParams(base=BASE), missing,
                 "exited during start-up(?s:.*)no-model-here")
