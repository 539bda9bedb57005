"""The seam-cost benchmark on a tiny setting, so it does not rot: a run, not a measurement (the
figures are in docs/performance.md). Cost: two cluster starts and two short load runs, about
80 s on CI's machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import CLUSTER_START, phase

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_seam_cost_times_seams_on_both_schedulers_and_reads_each_arms_cpu(monkeypatch, tmp_path, capsys):
    """Hardened with and without the switch: the switched servers (forked schedulers included)
    write their totals, H8's check is timed on decode's scheduler loop, both arms' CPU is read."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_seam_cost as sc

    start = sc.start

    def counted_start(env, params, model):
        with phase(f"{CLUSTER_START} {params.base} (benchmark)"):
            return start(env, params, model)

    monkeypatch.setattr(sc, "start", counted_start)
    sc.main(["--base", "0.5.23", "--arms", "hardened,seams", "--runs", "1", "--prompts", "4", "--warmup", "0",
             "--input-len", "128", "--output-len", "16", "--concurrency", "2", "--json", str(tmp_path / "sc.json")])
    out = capsys.readouterr().out
    assert "all seams / both scheduler loops" in out and "seams/hardened" in out
    runs = {r["arm"]: r for r in json.loads((tmp_path / "sc.json").read_text())["runs"]}
    assert all(runs[arm]["group_cpu_ns"][role] > 0 for arm in runs for role in sc.ROLES)
    seams = runs["seams"]["seams"]
    assert all(seams[role]["scheduler_ns"] > 0 for role in sc.ROLES)
    check = seams["decode"]["seams"]["page_tags_seams.refuse_untagged|scheduler loop"]
    assert check["ids"] == ["H8"] and check["calls"] == runs["seams"]["requests"]
