"""The A/B benchmark's schedule and statistics (benchmarks/bench_serving_ab.py), without clusters."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def ab(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_serving_ab

    return bench_serving_ab


def test_each_pair_runs_every_arm_once_and_no_arm_always_first(ab):
    order = ab.schedule(["upstream", "upstream-again", "hardened"], 3)
    assert len(order) == 9
    for pair in range(3):
        assert sorted(a for p, a in order if p == pair) == ["hardened", "upstream", "upstream-again"]
    assert {order[3 * p][1] for p in range(3)} == {"upstream", "upstream-again", "hardened"}


def test_the_interval_holds_the_median_and_narrows_with_agreement(ab):
    rng = random.Random(0)
    med, lo, hi = ab.bootstrap_median([0.9, 1.0, 1.1, 1.0, 0.95, 1.05], rng)
    assert lo <= med <= hi and med == pytest.approx(1.0)
    assert ab.bootstrap_median([1.02] * 5, rng) == (1.02, 1.02, 1.02)


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
                        (["--concurrency", "1,4", "--prompts", "8"], "--prompts")):
        with pytest.raises(SystemExit) as done:
            ab.main(argv)
        assert done.value.code == 2 and named in capsys.readouterr().err
