"""A restart that fails names the server that exited: the one restarted, or another of the cluster
that died meanwhile (a soak's rolling restart reads the error to tell which server went down).

Real child processes stand in for the servers (what is judged is how their exits are reported,
not SGLang). Tier: full (about 3 s, no cluster start).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from sglang_hardened.sandbox.cluster import Cluster, ClusterParams, Proc, child_env, free_port, spawn
from sglang_hardened.sandbox.env import SandboxEnv, SandboxError

pytestmark = pytest.mark.full

WAITS = "import time; time.sleep(60)"  # never healthy: nothing listens on its port


def _restart_fails(tmp_path: Path, programs: dict[str, str]) -> tuple[str, Cluster]:
    """Start the given Python programs as a cluster's servers, each on a port nothing listens on,
    restart ``prefill``, and return the first line of the error it fails with (and the cluster)."""
    env = SandboxEnv("0.5.23", Path(sys.executable), ())
    cluster = Cluster(ClusterParams(base="0.5.23"), uuid.uuid4().hex[:12], tmp_path)
    try:
        for name, program in programs.items():
            cmd = [sys.executable, "-c", program]
            pid, log = spawn(name, cmd, child_env(env, cluster.params, cluster.run_id), tmp_path)
            port = free_port()
            cluster.procs[name] = Proc(name, pid, log, f"http://127.0.0.1:{port}", port, cmd)
        with pytest.raises(SandboxError) as raised:
            cluster.restart("prefill", env, deadline_s=60)
    finally:
        cluster.stop()
    return str(raised.value).split("\n", 1)[0], cluster


def test_a_peer_that_exits_while_a_server_restarts_is_the_one_named(tmp_path):
    said, cluster = _restart_fails(tmp_path, {"prefill": WAITS, "decode": "import sys, time; time.sleep(1); sys.exit(3)"})
    assert said.startswith("decode exited while prefill started (exit code 3; its log: "), said
    assert cluster.procs["decode"].log in said and "prefill exited" not in said, said


def test_a_restarted_server_that_exits_is_named_with_its_code(tmp_path):
    said, cluster = _restart_fails(tmp_path, {"prefill": "import sys; sys.exit(5)", "decode": WAITS})
    assert said == f"prefill exited during start-up (exit code 5; its log: {cluster.procs['prefill'].log})", said
