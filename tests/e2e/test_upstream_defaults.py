"""What upstream 0.5.23 says about itself and runs with when started as its docs say (H0, H10's
upstream side): preflight finds no `hardening` field in /server_info, so nothing tells an operator
which fixes it carries, and KV checksums off on both roles, the setting `launch` turns on; and
whom its bootstrap server takes registrations from (H14's upstream side), and whose requests a
client's rid ends (H15's). The twins are
tests/e2e/test_probes_safe.py's, on a hardened 0.5.23 started through `launch`. The cluster is
test_lb.py's (shared: no start of its own when both run)."""

from __future__ import annotations

import json

import pytest

from sglang_hardened.operations.preflight import preflight

from tests.harness import eventually

from .scenarios import (ATTACKER, ATTACKER_RIDS, DEAD_PORT, RANK0, TIMEOUT_PARAMS, bootstrap_call, rank0_registration,
                        rid_prefix_attack)

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


@pytest.mark.claim("H14", "upstream")
def test_upstream_0523_lets_any_host_replace_a_prefill_ranks_registration(shared_cluster):
    """A tokenless PUT from another address points rank 0 at a dead port: every decode that
    bootstraps after it (a restart, a new replica) sends its transfers there. Put back at the
    end, so the shared cluster's next decode start is not the one that pays."""
    genuine, body = rank0_registration(shared_cluster)
    try:
        assert bootstrap_call(shared_cluster, "PUT", "/route", {**body, "rank_port": DEAD_PORT},
                              source=ATTACKER) == (200, "OK")
        status, text = bootstrap_call(shared_cluster, "GET", f"/route?{RANK0}")
        assert status == 200 and json.loads(text)["rank_port"] == DEAD_PORT, text
    finally:
        assert bootstrap_call(shared_cluster, "PUT", "/route", body)[0] == 200
    assert json.loads(bootstrap_call(shared_cluster, "GET", f"/route?{RANK0}")[1]) == genuine


@pytest.mark.claim("H15", "upstream")
def test_upstream_0523_lets_a_client_end_other_tenants_requests_by_rid_prefix(shared_cluster):
    """Sixteen one-character rids and a hang-up end all four victims: each victim's rid starts
    with one of them, and the scheduler aborts every rid an abort's rid prefixes."""
    with rid_prefix_attack(shared_cluster) as victims:
        assert eventually(lambda: all(v.done() for v in victims), 30, 0.2), "the victims were not ended"
        replies = [v.result() for v in victims]
    assert all(r.status == 500 and "Aborted by AbortReq" in r.body for r in replies), \
        [(r.status, r.body[:200]) for r in replies]
    assert len(ATTACKER_RIDS) == 16
