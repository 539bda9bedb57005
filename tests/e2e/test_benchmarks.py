"""The cluster benchmarks on a tiny setting, so they do not rot: a run, not a measurement (the
figures are in docs/performance.md). Cost: two cluster starts, four short load runs and two
abort storms of four requests on the same clusters, about 75 s on CI's machine; H6's growth
table on one Mooncake pair, about 10 s."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import PAGE_TAGS
from tests.harness import CLUSTER_START, phase

pytestmark = pytest.mark.e2e

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_serving_ab_writes_its_table_json_and_plot_from_one_run(monkeypatch, tmp_path, capsys):
    """Upstream and hardened with H8 switched off (the arm that exercises the switch end to
    end: its servers say so and serve every request), one pair, SGLang's own load generator."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_serving_ab as ab

    started = []

    def counted_start(env, params, model):
        with phase(f"{CLUSTER_START} {params.base} (benchmark)"):
            started.append(start(env, params, model))
            return started[-1]

    start = ab.start
    monkeypatch.setattr(ab, "start", counted_start)
    ab.main(["--base", "0.5.23", "--arms", "upstream,hardened-h8-off", "--pairs", "1", "--concurrency", "2",
             "--prompts", "4", "--warmup", "0", "--input-len", "128", "--output-len", "16",
             "--abort-shares", "50", "--storm-requests", "4", "--storm-concurrency", "2",
             "--json", str(tmp_path / "ab.json"), "--plot", str(tmp_path / "ab.png"),
             "--storm-plot", str(tmp_path / "storm.png")])
    out = capsys.readouterr().out
    assert "hardened-h8-off/upstream" in out and "peak RSS decode MiB" in out
    assert "req/s, stayed" in out and "requests that stayed and got no 200: none" in out
    data = json.loads((tmp_path / "ab.json").read_text())
    assert [(r["arm"], r["result"]["request_throughput"] > 0) for r in data["runs"]] == [
        ("upstream", True), ("hardened-h8-off", True)]
    assert {r["metric"] for r in data["ratios"]} == {key for key, _ in ab.METRICS}
    assert all(math.isfinite(r["median"]) and r["median"] > 0 for r in data["ratios"])
    assert [(r["arm"], r["aborted %"], r["result"]["req_s"] > 0) for r in data["storms"]] == [
        ("upstream", 50, True), ("hardened-h8-off", 50, True)]
    for png in ("ab.png", "storm.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    off = {c.params.extra_env: Path(c.procs["decode"].log).read_text() for c in started}
    assert "page tags OFF on this decode" in off[(f"{PAGE_TAGS.name}=off",)] and "page tags OFF" not in off[()]


def test_transfer_growth_table_bounds_every_size_and_says_where_one_call_fails(monkeypatch, capsys, tmp_path):
    """H6's growth on a tiny setting: one size under Mooncake TCP's per-call limit, one over it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_transfer_bounds

    bench_transfer_bounds.main(["--growth", "1024,4096", "--repeat", "1", "--plot", str(tmp_path / "h6.png")])
    out = capsys.readouterr().out
    assert re.search(r"^1024 +4 +1 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)  # one bounded call, one unbounded
    assert re.search(r"^4096 +16 +4 +[\d.]+ +[\d.]+ +fails \(rc -?\d+\) +-$", out, re.M)
    assert (tmp_path / "h6.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
