"""`sandbox up|status|soak|down` as a user runs it: detached cluster, JSON status, a soak that
kills and restarts a server (its new pid kept for the next command), clean stop."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from sglang_hardened.operations.oracle import generate
from sglang_hardened.sandbox.cluster import marked_pids, port_in_use
from sglang_hardened.sandbox.soak.plan import FAULTS
from tests.harness import CLUSTER_START, REPO, SERVER_RESTART, phase

pytestmark = pytest.mark.e2e
CLI = [sys.executable, "-c", "from sglang_hardened.sandbox.cli import sandbox; sandbox()"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args, "--name", "pytest"], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_sandbox_up_status_down():
    with phase(f"{CLUSTER_START} 0.5.23 mooncake (sandbox up)"):
        up = cli("up", "--base", "0.5.23", "--prefill-pool-tokens", "300", "--page-size", "4",
                 "--waiting-timeout", "30", "--instrument",
                 "--env", "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=4")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        info = json.loads(cli("status", "--json").stdout)
        assert info["running"] and info["params"]["prefill_pool_tokens"] == 300
        assert info["params"]["page_size"] == 4 and info["params"]["waiting_timeout_s"] == 30
        assert set(info["urls"]) == {"prefill", "decode", "lb"}
        assert generate(info["urls"]["lb"], "the key", max_new_tokens=2).status == 200
        with urllib.request.urlopen(f"{info['urls']['prefill']}/health", timeout=10) as r:
            assert r.status == 200
        # every request's fault is a decode kill: the first lands, the rest wait their turn
        no_other = [arg for name in FAULTS if name != "kill-decode" for arg in ("--rate", f"{name}=0")]
        with phase(f"{SERVER_RESTART} decode 0.5.23 mooncake (sandbox soak)"):
            soak = cli("soak", "--duration", "5", "--clients", "2", "--rate", "kill-decode=1", *no_other,
                       "--mix", "over-pool=0", "--json")  # this pool < context: upstream queues it past the bound
        assert soak.returncode in (0, 1) and soak.stdout.startswith("{"), soak.stderr
        report = json.loads(soak.stdout)
        assert soak.returncode == (0 if report["ok"] else 1) and report["faults"]["kill-decode"]["landed"] == 1, report
        after = json.loads(cli("status", "--json").stdout)
        assert after["running"] and after["procs"]["decode"]["pid"] != info["procs"]["decode"]["pid"]
        assert generate(after["urls"]["lb"], "the key", max_new_tokens=2).status == 200
        info = after
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not marked_pids(info["run_id"])
    assert not [p["port"] for p in info["procs"].values() if port_in_use(p["port"])]
    assert "not up" in cli("status").stdout
