"""The A/B benchmark's schedule and statistics (benchmarks/bench_serving_ab.py), without clusters."""

from __future__ import annotations

from collections import Counter

import pytest
from tests.harness import REPO

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def ab(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_serving_ab

    return bench_serving_ab


def test_each_pair_runs_every_arm_once_in_a_seeded_order_that_favours_none(ab):
    arms = ["upstream", "upstream-again", "hardened", "hardened-h8-off"]
    order = ab.schedule(arms, 400, seed=1)
    assert order == ab.schedule(arms, 400, seed=1) != ab.schedule(arms, 400, seed=2)
    for pair in range(400):
        assert sorted(a for p, a in order if p == pair) == sorted(arms)
    firsts = Counter(order[4 * p][1] for p in range(400))
    after_upstream = Counter(order[i + 1][1] for i in range(len(order) - 1) if order[i][1] == "upstream"
                             and order[i][0] == order[i + 1][0])
    assert all(70 <= firsts[a] <= 130 for a in arms)  # 100 each expected
    assert all(60 <= after_upstream[a] <= 140 for a in arms[1:])  # no arm always follows upstream


def test_the_interval_is_distribution_free_and_says_its_coverage(ab):
    med, lo, hi, coverage = ab.median_interval([1.3, 0.9, 1.0, 1.1, 0.95])
    assert (med, lo, hi, coverage) == (1.0, 0.9, 1.3, 0.9375)  # five pairs: the range, at 93.75 %
    values = [1.0 + i / 100 for i in range(20)]
    med, lo, hi, coverage = ab.median_interval(values)
    assert (lo, hi) == (values[5], values[14]) and 0.95 <= coverage < 0.98  # x(6), x(15) for n = 20
    assert ab.median_interval([1.02] * 7)[:3] == (1.02, 1.02, 1.02)


def test_ratios_pair_each_arm_with_the_baseline_of_its_own_pair(ab):
    def run(pair, arm, rps):
        return {"pair": pair, "arm": arm, "concurrency": 4,
                "result": {key: rps for key, _ in ab.METRICS}}

    runs = [run(0, "upstream", 10.0), run(0, "hardened", 9.0), run(1, "upstream", 20.0), run(1, "hardened", 18.0),
            run(2, "hardened", 1.0)]  # a pair whose upstream never ran counts for nothing
    found = ab.ratios(runs, ["upstream", "hardened"])
    assert {r["metric"] for r in found} == {key for key, _ in ab.METRICS}
    assert all(r["pairs"] == 2 and r["median"] == pytest.approx(0.9) for r in found)


def test_bad_arguments_are_refused_naming_them(ab, capsys):
    for argv, named in ((["--arms", "hardened"], "(no upstream)"), (["--arms", "upstream,fast"], "fast"),
                        (["--concurrency", "1,4", "--prompts", "8"], "--prompts"), (["--pin", "0-13"], "--pin")):
        with pytest.raises(SystemExit) as done:
            ab.main(argv)
        assert done.value.code == 2 and named in capsys.readouterr().err
