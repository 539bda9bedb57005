"""The seam-cost benchmark's arithmetic (benchmarks/bench_seam_cost.py), without clusters."""

from __future__ import annotations

import pytest
from tests.harness import REPO

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def sc(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_seam_cost

    return bench_seam_cost


def _process(pid: int, title: str, main_cpu_ns: int, seams: list[tuple[str, bool, int, int]]) -> dict:
    return {"pid": pid, "title": title, "main_cpu_ns": main_cpu_ns, "timer": {"recorded_ns": 100, "added_ns": 300},
            "seams": [{"seam": s, "ids": ["H8"], "main_thread": m, "calls": c, "cpu_ns": ns} for s, m, c, ns in seams]}


def test_a_seam_counts_its_window_less_the_timers_cost_and_the_scheduler_less_what_the_timer_added(sc):
    before = {"prefill": [_process(1, "sglang::scheduler_TP0", 1_000_000, [("a.f", True, 10, 5_000)]),
                          _process(2, "python", 0, [])],
              "decode": [_process(3, "sglang::scheduler_TP0", 0, [])]}
    after = {"prefill": [_process(1, "sglang::scheduler_TP0", 11_000_000,
                                  [("a.f", True, 30, 45_000), ("b.g", False, 5, 10_000)]),
                         _process(2, "python", 0, [("c.h", True, 4, 4_000)])],
             "decode": [_process(3, "sglang::scheduler_TP0", 2_000_000, [])]}
    found = sc.seam_deltas(before, after)
    prefill = found["prefill"]
    assert prefill["seams"]["a.f|scheduler loop"]["calls"] == 20
    assert prefill["seams"]["a.f|scheduler loop"]["cpu_ns"] == 40_000 - 20 * 100
    assert prefill["seams"]["b.g|scheduler, other thread"]["cpu_ns"] == 10_000 - 5 * 100
    assert prefill["seams"]["c.h|other process"]["cpu_ns"] == 4_000 - 4 * 100
    assert prefill["timer_ns"] == 20 * 300  # only the scheduler loop's calls slow the loop down
    assert prefill["scheduler_ns"] == 10_000_000 - 20 * 300
    assert found["decode"]["scheduler_ns"] == 2_000_000 and found["decode"]["seams"] == {}


def test_the_tables_give_each_seam_its_share_and_the_ratios_their_interval(sc):
    runs = []
    for run, (seam_ns, scale) in enumerate(((10_000, 1.00), (12_000, 1.02), (11_000, 0.98))):
        seams = {role: {"seams": {"a.f|scheduler loop": {"ids": ["H8"], "calls": 4, "cpu_ns": float(seam_ns)}},
                        "scheduler_ns": 1_000_000.0, "timer_ns": 1_000.0} for role in sc.ROLES}
        for arm, cpu in (("upstream", 100e6), ("hardened", 100e6 * scale), ("seams", 101e6 * scale)):
            runs.append({"run": run, "arm": arm, "requests": 2, "group_cpu_ns": {r: cpu for r in sc.ROLES}}
                        | ({"seams": seams} if arm == "seams" else {}))
    seam_rows = sc.seam_table(runs)
    assert "5.50 ± 1.24" in seam_rows  # us per request: 5, 6, 5.5, sd 0.5, t(2) = 4.303
    assert "1.100 ± 0.248" in seam_rows  # % of the scheduler loop's 500 us per request
    cpu_rows = sc.cpu_table(runs)
    assert "1.000 [0.980, 1.020]" in cpu_rows and "1.010 [1.010, 1.010]" in cpu_rows
