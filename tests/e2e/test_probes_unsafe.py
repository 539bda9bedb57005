"""preflight and canary against the incident's deployment: upstream 0.5.19, prefill pool < context.

Both must fail it: preflight from what the nodes report (unhardened, pool below context,
decode accepting longer inputs than prefill), canary from what the deployment answers
(the over-pool prompt gets a 200, and the probe's output changes with the previous tenant),
probing through `sglang-hardened lb`. The cluster is test_incident.py's.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.operations.canary import Plan, run_canary
from sglang_hardened.operations.preflight import preflight

from .conftest import sandbox_env
from .scenarios import LEAK_PARAMS

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.19", False, LEAK_PARAMS)


def test_preflight_flags_the_unsafe_deployment_with_remedies(shared_cluster, tmp_path):
    report = preflight([shared_cluster.prefill_url], [shared_cluster.decode_url])
    unsafe = {(f.where.split()[0], f.what.split(",")[0]) for f in report.findings if f.severity == "unsafe"}
    assert not report.ok
    assert ("prefill", "sglang 0.5.19 is not a hardened build") in unsafe
    assert ("decode", "sglang 0.5.19 is not a hardened build") in unsafe
    assert ("prefill", "KV pool holds 256 tokens") in unsafe
    assert any(where == "decode" and what.startswith("accepts inputs up to") for where, what in unsafe)
    assert all(f.remedy for f in report.findings)
    out = tmp_path / "preflight.json"
    result = CliRunner().invoke(main, ["preflight", "--prefill", shared_cluster.prefill_url,
                                       "--decode", shared_cluster.decode_url, "--json", str(out)])
    assert result.exit_code == 1 and "UNSAFE" in result.output and "256/1024" in result.output, result.output
    assert json.loads(out.read_text())["ok"] is False


def test_canary_fails_the_leaking_deployment(shared_cluster):
    lb_url = shared_cluster.add_lb("hardened", sandbox_env("0.5.19"))
    p = shared_cluster.params
    repeats = math.ceil(p.decode_pool_tokens / (min(p.prefill_pool_tokens, p.context_length) * 7 // 10)) + 1
    # Three rounds, not the default two: the tiny random model's greedy answer often falls into the
    # same loop whatever it attends to, and each round is another chance for it to differ. (Before
    # tenants' prompts differed beyond their canaries, one CI run in several saw no difference.)
    report = run_canary(lb_url, Plan(p.prefill_pool_tokens, p.context_length, repeats=repeats, rounds=3,
                                      max_requests=120), tokenize_url=shared_cluster.prefill_url)
    checks = {c.name.split(" (")[0]: c for c in report.checks}
    assert not report.ok
    assert not checks["over-pool prompt"].ok and "200" in checks["over-pool prompt"].detail
    assert not checks["over-pool probe independent of the previous tenant"].ok
    # the tiny model never repeats a canary: that check is shown failing in tests/integration/test_probes_judge.py
    assert checks["no tenant sees another's canary"].result == "n/a"
    assert report.requests <= 120
