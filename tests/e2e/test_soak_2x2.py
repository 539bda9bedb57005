"""The chaos soak (sglang_hardened/sandbox/soak) on 2 prefills x 2 decodes behind mini-lb, so it
does not rot: faults aimed at one server while the others serve, then a rolling restart under
traffic; every request judged against the quiet cluster, every page of every server by the ledger.
docs/soak.md has the long runs, upstream's violations among them.

Tier and cost: full tier only (it carries no claim: the soak's claims, H11 and H12, are shown in
the gate on one pair by tests/e2e/test_fault_matrix.py). One hardened 0.5.23 Mooncake 2x2 start
and four restarts (the roll, one server at a time). Measured 2026-12-06 on the shared 2-core
machine at load average 15 (`scripts/test tests/e2e/test_soak_2x2.py`): 738 s, the start 129 s,
the aimed faults' soak 50 s, the roll 406 s (restarts of 76-119 s, where CI's take about 15 s).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_hardened.sandbox.ledger import Ledger
from sglang_hardened.sandbox.soak.faults import group_pids
from sglang_hardened.sandbox.soak.plan import SoakPlan
from sglang_hardened.sandbox.soak.report import SoakReport
from sglang_hardened.sandbox.soak.run import run_soak

from .conftest import restart
from .test_fault_matrix import PARAMS, RELEASE_TIMEOUT_S, Build, FaultCluster, start_fault_cluster

pytestmark = pytest.mark.e2e

# Decode's waiting (and bootstrap) timeout: a handshake with a prefill restarted under it fails
# within this, and the soak's bound covers it (the fault matrix's 300 s would make every such wait a hang).
WAITING_S = 30
AIMED = {"abort-prefill": 0.06, "abort-decode": 0.06, "stop-prefill": 0.08, "stop-decode": 0.08, "fail-part-way": 0.1}
PART_WAY_HIT = re.compile(r"SANDBOX PAGE FAULT fail-part-way")


@pytest.fixture(scope="module")
def fc(tmp_path_factory):
    """A hardened 0.5.23 Mooncake 2x2 fault cluster (the fault matrix's instruments and settings)."""
    fault_cluster = start_fault_cluster(Build("0.5.23", "mooncake", True), tmp_path_factory.mktemp("instruments"),
                                        dict(PARAMS, prefills=2, decodes=2, waiting_timeout_s=WAITING_S))
    yield fault_cluster
    fault_cluster.cluster.stop()


def soak(fc: FaultCluster, **plan) -> SoakReport:
    report = run_soak(fc.cluster, SoakPlan(RELEASE_TIMEOUT_S, waiting_timeout_s=WAITING_S, **plan),
                      restart=lambda name: restart(fc.cluster, name, fc.env), progress=print,
                      instruments=fc.instruments)
    print(f"\n{report.table()}")
    return report


def pids(fc: FaultCluster, name: str) -> set[str]:
    return {str(pid) for pid in group_pids(fc.cluster.procs[name].pid)}


def test_faults_aimed_at_one_server_while_the_others_serve(fc):
    """Stops and part-way failures on one server at a time, aborts to every server of a role:
    no violation; more than one server was hit; a part-way failure hit its prefill's writes only;
    the ledger judged every server (each prefill wrote, each decode took pages)."""
    logs = {name: len(Path(fc.cluster.procs[name].log).read_text(errors="replace")) for name in fc.cluster.servers("prefill")}
    report = soak(fc, seed=8675309, clients=4, duration_s=40.0, rates=AIMED)  # a seed that once stopped the soak
    assert report.ok, report.table()
    assert len(report.outcomes) >= 20, "too little to judge"
    aimed = [f for f in report.faults if f.landed and f.name in ("stop-prefill", "stop-decode", "fail-part-way")]
    assert all(len(f.targets) == 1 for f in aimed) and len({f.targets[0] for f in aimed}) >= 2, report.faults
    part_way = {f.targets[0] for f in aimed if f.name == "fail-part-way"}
    for name, start in logs.items():
        hits = PART_WAY_HIT.findall(Path(fc.cluster.procs[name].log).read_text(errors="replace")[start:])
        assert not hits or name in part_way, f"{name}'s transfers failed part-way, but the fault named {part_way}"
    ledger = Ledger(fc.ledger_dir)
    writers, takers = {e["pid"] for e in ledger.of("begin")}, {e["pid"] for e in ledger.of("expose")}
    for role, seen in (("prefill", writers), ("decode", takers)):
        for name in fc.cluster.servers(role):
            assert pids(fc, name) & seen, f"the ledger has nothing of {name}"


def test_a_rolling_restart_under_traffic(fc):
    """Every server replaced in turn (prefills first), each healthy before the next, while two
    clients send for the first minute of it: no violation, every server has new processes,
    their pages back to idle."""
    servers = [*fc.cluster.servers("prefill"), *fc.cluster.servers("decode")]
    before = {name: fc.cluster.procs[name].pid for name in servers}
    # every request carries a roll: the first lands, the rest are skipped while it runs
    report = soak(fc, seed=4242, clients=2, duration_s=60.0, rates={"rolling-restart": 1.0})
    assert report.ok, report.table()
    [roll] = [f for f in report.faults if f.landed]
    assert roll.name == "rolling-restart" and list(roll.targets) == servers, roll
    assert all(fc.cluster.procs[name].pid != pid for name, pid in before.items()), "a server was not replaced"
