"""preflight and canary pass a safe deployment: hardened 0.5.23, pools that hold the context,
both servers started through `sglang-hardened launch` as an operator would (H10's policy applied
where it runs: the flags it adds must start, serve, and read back from /server_info), with the
bootstrap token the sandbox sets as the recipe does; and its bootstrap server refuses a forged
registration (H14), so decode still serves after a restart, and a client's rid ends only its
own requests (H15)."""

from __future__ import annotations

import json

import pytest

from sglang_hardened.common.pythons import runs_on
from sglang_hardened.operations.canary import Plan, run_canary
from sglang_hardened.operations.oracle import generate
from sglang_hardened.operations.preflight import preflight
from sglang_hardened.runtime.bootstrap_auth import TOKEN_HEADER
from tests.harness import eventually

from .conftest import restart
from .scenarios import (ATTACKER, ATTACKER_RIDS, DEAD_PORT, FITTING_C, RANK0, attacker_aborts, bootstrap_call,
                        rank0_registration, rid_prefix_attack)

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.23", True, dict(prefill_pool_tokens=2048, decode_pool_tokens=4096, context_length=1024, lb="hardened",
                                via_launch=True, python="3.12"))  # production's Python: the official image's


@pytest.mark.claim("H0", "hardened")
@pytest.mark.claim("H10", "hardened")
def test_preflight_passes_a_safe_deployment(shared_cluster):
    report = preflight([shared_cluster.prefill_url], [shared_cluster.decode_url])
    assert report.ok, report.findings
    assert not report.findings, "launch's policy leaves preflight nothing to warn of (KV checksums on)"
    assert all(n.get("disaggregation_enable_kv_checksum") is True for n in report.nodes)
    assert all(n.hardening["hardened"] and "H7" in n.hardening["hardening_ids"] for n in report.nodes)
    assert report.nodes[0].bootstrap_limit == report.nodes[0].get("max_req_input_len")  # read from /hardened/limits


@pytest.mark.gate
def test_the_servers_run_the_wheel_built_for_production_python(shared_cluster):
    """The gate's one cluster on Python 3.12, the official image's (the others run 3.11): each
    server runs upstream's cp312 wheel hardened, and says so."""
    report = preflight([shared_cluster.prefill_url], [shared_cluster.decode_url])
    assert [n.hardening.get("runs_on") for n in report.nodes] == [runs_on(CLUSTER[2]["python"])] * 2


def test_canary_passes_a_safe_deployment(shared_cluster):
    p = shared_cluster.params
    report = run_canary(shared_cluster.lb_url, Plan(p.prefill_pool_tokens, p.context_length, repeats=2, rounds=1),
                        tokenize_url=shared_cluster.prefill_url)  # the lb serves no /tokenize
    assert report.ok, report.to_json()
    assert report.requests == Plan(p.prefill_pool_tokens, p.context_length, repeats=2, rounds=1).requests_needed


@pytest.mark.claim("H14", "hardened")
def test_a_forged_registration_changes_nothing_and_decode_serves_after_a_restart(shared_cluster):
    """Upstream's twin: tests/e2e/test_upstream_defaults.py. One decode restart (the gate's
    budget counts it): the decode that bootstraps afresh reads rank 0's genuine address."""
    genuine, body = rank0_registration(shared_cluster)
    forged = {**body, "rank_port": DEAD_PORT}
    token = {TOKEN_HEADER: shared_cluster.bootstrap_token}
    for headers, source, status in (({}, ATTACKER, 403), ({TOKEN_HEADER: "guess"}, ATTACKER, 403),
                                    ({}, "127.0.0.1", 403), (token, ATTACKER, 409)):
        reply = bootstrap_call(shared_cluster, "PUT", "/route", forged, headers, source)
        assert reply[0] == status and shared_cluster.bootstrap_token not in reply[1], (headers, source, reply)
    assert bootstrap_call(shared_cluster, "POST", "/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 0},
                          source=ATTACKER)[0] == 403
    assert bootstrap_call(shared_cluster, "PUT", "/route", "not json", token)[0] == 400  # named, not a 500
    assert json.loads(bootstrap_call(shared_cluster, "GET", f"/route?{RANK0}")[1]) == genuine
    restart(shared_cluster, "decode", shared_cluster.envs["decode"])
    replies = []  # the lb takes decode back at its next health check (every 5 s)
    assert eventually(lambda: replies.append(generate(shared_cluster.lb_url, FITTING_C, max_new_tokens=4,
                                                      timeout=120)) or replies[-1].status == 200, 60, 1.0), \
        [(r.status, r.body[:300]) for r in replies[-2:]]


@pytest.mark.claim("H15", "hardened")
def test_a_clients_rid_ends_only_its_own_requests(shared_cluster):
    """Upstream's twin: tests/e2e/test_upstream_defaults.py. Once decode has ended every one of
    the attacker's requests, the four victims still wait for their prefill."""
    with rid_prefix_attack(shared_cluster) as victims:
        assert eventually(lambda: attacker_aborts(shared_cluster) == set(ATTACKER_RIDS), 30, 0.5), \
            sorted(attacker_aborts(shared_cluster))
        assert not any(v.done() for v in victims), [v.result().body[:200] for v in victims if v.done()]
