"""The seam-cost benchmark on a tiny setting, so it does not rot: a run, not a measurement (the
figures are in docs/performance.md). Full tier. Cost: three cluster starts (the seams arm and
the two syncs arms, whose scheduler runs under the overlay's dispatch mode) and three short load
runs: 741 s on the 2-core machine under other sessions' load (2026-12-06), 263 s of it starts and
about 8 minutes building the environments it found cold."""

from __future__ import annotations

import json

import pytest

from tests.harness import CLUSTER_START, REPO, phase

pytestmark = pytest.mark.e2e


def test_seam_cost_times_seams_and_counts_syncs_on_both_schedulers(monkeypatch, tmp_path, capsys):
    """The switched servers (forked schedulers included) write their totals, H8's check is timed
    on decode's scheduler loop; the syncs arms count on both builds' loops, H8's check's host
    read given to its seam on the hardened one, no seam's on upstream; the summary table and
    the plot are written."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_seam_cost as sc

    start = sc.start

    def counted_start(env, params, model):
        with phase(f"{CLUSTER_START} {params.base} (benchmark)"):
            return start(env, params, model)

    monkeypatch.setattr(sc, "start", counted_start)
    sc.main(["--base", "0.5.23", "--arms", "seams,upstream-syncs,hardened-syncs", "--runs", "1", "--prompts", "4",
             "--warmup", "0", "--input-len", "128", "--output-len", "16", "--concurrency", "2",
             "--json", str(tmp_path / "sc.json"), "--plot", str(tmp_path / "sc.png")])
    out = capsys.readouterr().out
    assert "all seams / both scheduler loops" in out and "syncs/req hardened" in out
    assert (tmp_path / "sc.png").stat().st_size > 0
    runs = {r["arm"]: r for r in json.loads((tmp_path / "sc.json").read_text())["runs"]}
    assert all(r["group_cpu_ns"][role] > 0 for r in runs.values() for role in sc.ROLES)
    seams = runs["seams"]["seams"]
    assert all(seams[role]["scheduler_ns"] > 0 for role in sc.ROLES)
    check = seams["decode"]["seams"]["page_tags.seams.refuse_untagged|scheduler loop"]
    assert check["ids"] == ["H8"] and check["calls"] == runs["seams"]["requests"]

    def owners(arm: str, role: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for key, n in runs[arm]["syncs"][role].items():
            found[key.split("|")[1]] = found.get(key.split("|")[1], 0) + n
        return found

    assert all(owners(arm, role).get("upstream") for arm in ("upstream-syncs", "hardened-syncs") for role in sc.ROLES)
    assert set(owners("upstream-syncs", "decode")) <= {"upstream", "upstream forward", "harness"}
    assert owners("hardened-syncs", "decode")["page_tags.seams.refuse_untagged"] == runs["hardened-syncs"]["requests"]
