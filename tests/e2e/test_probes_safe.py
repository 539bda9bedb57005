"""preflight and canary pass a safe deployment: hardened 0.5.23, pools that hold the context,
both servers started through `sglang-hardened launch` as an operator would (H10's policy applied
where it runs: the flags it adds must start, serve, and read back from /server_info)."""

from __future__ import annotations

import pytest

from sglang_hardened.operations.canary import Plan, run_canary
from sglang_hardened.operations.preflight import preflight

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.23", True, dict(prefill_pool_tokens=2048, decode_pool_tokens=4096, context_length=1024, lb="hardened",
                                via_launch=True))


@pytest.mark.claim("H0", "hardened")
@pytest.mark.claim("H10", "hardened")
def test_preflight_passes_a_safe_deployment(shared_cluster):
    report = preflight([shared_cluster.prefill_url], [shared_cluster.decode_url])
    assert report.ok, report.findings
    assert not report.findings, "launch's policy leaves preflight nothing to warn of (KV checksums on)"
    assert all(n.get("disaggregation_enable_kv_checksum") is True for n in report.nodes)
    assert all(n.hardening["hardened"] and "H7" in n.hardening["hardening_ids"] for n in report.nodes)
    assert report.nodes[0].bootstrap_limit == report.nodes[0].get("max_req_input_len")  # read from /hardened/limits


def test_canary_passes_a_safe_deployment(shared_cluster):
    p = shared_cluster.params
    report = run_canary(shared_cluster.lb_url, Plan(p.prefill_pool_tokens, p.context_length, repeats=2, rounds=1))
    assert report.ok, report.to_json()
    assert report.requests == Plan(p.prefill_pool_tokens, p.context_length, repeats=2, rounds=1).requests_needed
