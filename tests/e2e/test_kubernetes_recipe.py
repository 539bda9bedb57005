"""The Kubernetes recipe's own commands start, serve, gate and canary a PD deployment.

deploy/kubernetes/lws is rendered with CPU-sized parameters and each container's command,
arguments and environment run as the kubelet would start them (sandbox/recipe.py). Stand-ins,
and only these: each Service is 127.0.0.1 with a free port, the servers get the sandbox's CPU
flags, the params name the sandbox's model and Mooncake over TCP (no RDMA NIC here).
Each Secret the pods read holds a random value, and smg's worker routes are shown to take only its key.
Cost: two server starts, the gateway, one canary run and one refused prefill start.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.sandbox import recipe
from sglang_hardened.sandbox.cluster import healthy
from sglang_hardened.sandbox.model import ensure_model
from tests.harness import CLUSTER_START, SERVER_RESTART, phase

from .conftest import PORTS_USED, sandbox_env
from .test_smg_control_plane import REFUSED, admin_key, call

pytestmark = pytest.mark.e2e

BASE = "0.5.23"
# A CPU-sized deployment: the pools hold the context on both roles, as deploy check wants.
CPU_PARAMS = {"CONTEXT_LENGTH": "1024", "PREFILL_MAX_TOTAL_TOKENS": "2048", "DECODE_MAX_TOTAL_TOKENS": "4096",
              "PAGE_SIZE": "16", "TRANSFER_BACKEND": "mooncake_tcp"}


H7_REFUSAL = "sglang-hardened H7: this prefill server's KV pool holds"


def params_text(**values: str) -> str:
    text = recipe.RECIPE.joinpath("params", "params.env").read_text()
    for key, value in values.items():
        text, count = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
        assert count == 1, key
    return text


@pytest.fixture
def deployment(request, tmp_path):
    env = sandbox_env(BASE, hardened=True)
    model = str(ensure_model(env, "tiny"))
    with phase(f"{CLUSTER_START} {BASE} recipe"):
        running = recipe.start(env, recipe.render("lws", params_text(MODEL_PATH=model, **CPU_PARAMS)))
    request.node.sandbox_clusters = [running.cluster]
    PORTS_USED.extend([*running.local.values()])
    yield running, model, tmp_path
    running.cluster.stop()


def test_the_recipes_commands_serve_pass_the_gate_and_the_canary_and_an_unsafe_pool_fails_the_gate(deployment):
    running, model, tmp_path = deployment
    assert running.cluster.generate("the recipe serves").status == 200  # through smg, as a client would
    # smg's worker routes take the Secret's key only, as the recipe passes it
    assert call(running.cluster.lb_url, "GET", "/workers")[0] in REFUSED
    assert call(running.cluster.lb_url, "GET", "/workers", admin_key(running.cluster, "lb"))[0] == 200

    gate = running.containers["gateway/preflight-gate"]
    passed = running.run(gate, gate.probe, timeout_s=120)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "preflight: ok" in passed.stdout

    canary = running.containers["canary/canary"]
    probed = running.run(canary, canary.argv, timeout_s=900)
    assert probed.returncode == 0, probed.stdout[-3000:] + probed.stderr[-3000:]
    report = json.loads(probed.stdout)  # --json alone: stdout is the report, the table went to stderr
    assert report["ok"] and any(c["result"] == "ok" for c in report["checks"]), report

    # The same recipe with prefill's pool under the context: deploy check refuses the file before
    # anything is applied; applied anyway, H7 refuses to start prefill and the gate fails.
    unsafe_text = params_text(MODEL_PATH=model, **{**CPU_PARAMS, "PREFILL_MAX_TOTAL_TOKENS": "512"})
    shutil.copytree(recipe.RECIPE, tmp_path / "kubernetes")  # the operator's copy of the recipe
    (tmp_path / "kubernetes" / "params" / "params.env").write_text(unsafe_text)
    checked = CliRunner().invoke(main, ["deploy", "check", str(tmp_path / "kubernetes" / "params" / "params.env")])
    assert checked.exit_code == 1 and "fewer than the context length 1024" in " ".join(checked.output.split())
    unsafe_prefill = recipe.containers(recipe.render("lws", unsafe_text))["prefill/server"]
    with phase(f"{SERVER_RESTART} prefill {BASE} recipe"):
        running.start_server(unsafe_prefill)
        deadline = time.monotonic() + 180
        while H7_REFUSAL not in running.cluster.log_tail("prefill", 80) and time.monotonic() < deadline:
            assert not healthy(running.cluster.prefill_url), "prefill started with a pool under its context"
            time.sleep(1)
    assert "fewer than its context length 1024" in running.cluster.log_tail("prefill", 80)
    assert not healthy(running.cluster.prefill_url)
    failed = running.run(gate, gate.probe, timeout_s=120)
    assert failed.returncode == 1, failed.stdout
    assert "not reachable" in failed.stdout and "preflight: UNSAFE" in failed.stdout
