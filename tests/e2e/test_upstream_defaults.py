"""What upstream 0.5.23 says about itself and runs with when started as its docs say (H0, H10's
upstream side): preflight finds no `hardening` field in /server_info, so nothing tells an operator
which fixes it carries, and KV checksums off on both roles, the setting `launch` turns on. The
twins are tests/e2e/test_probes_safe.py's, on a hardened 0.5.23 started through `launch`. The
cluster is test_lb.py's (shared: no start of its own when both run)."""

from __future__ import annotations

import pytest

from sglang_hardened.operations.preflight import preflight

from .scenarios import TIMEOUT_PARAMS

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.23", False, TIMEOUT_PARAMS)


@pytest.mark.claim("H0", "upstream")
@pytest.mark.claim("H10", "upstream")
def test_upstream_0523_says_nothing_of_its_fixes_and_runs_without_kv_checksums(shared_cluster):
    report = preflight([shared_cluster.prefill_url], [shared_cluster.decode_url])
    found = {(f.where.split()[0], f.severity, f.what) for f in report.findings}
    for role in ("prefill", "decode"):
        assert (role, "unsafe", "sglang 0.5.23 is not a hardened build") in found, found
        assert (role, "warn", "KV checksums are off") in found, found
    assert all(n.info is not None and "hardening" not in n.info for n in report.nodes), \
        "upstream's /server_info has no hardening field"
    assert all(n.get("disaggregation_enable_kv_checksum") is False for n in report.nodes)
