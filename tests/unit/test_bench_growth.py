"""The in-process growth benchmarks on tiny settings, so they do not rot: a run, not a
measurement (the figures are in docs/performance.md). About 10 s, no cluster."""

from __future__ import annotations

import logging
import re

import pytest
from sglang_hardened.common.knobs import BOOTSTRAP_TOKEN
from tests.harness import REPO

BENCHMARKS = REPO / "benchmarks"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def benchmarks_on_path(monkeypatch):
    """The benchmarks' own path, and the hardening logger's level back after: a main that
    silences it (the fault check's refusals are expected there) must not silence later tests."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    logger = logging.getLogger("sglang_hardened")
    monkeypatch.setattr(logger, "level", logger.level)


def test_page_tags_growth_gives_a_row_per_page_count_and_a_plot(tmp_path, capsys):
    import bench_page_tags

    bench_page_tags.main(["--growth", "16,64", "--repeat", "3", "--plot", str(tmp_path / "g.png")])
    out = capsys.readouterr().out
    rows = re.findall(r"^(16|64) +([\d.]+) +[\d.]+ +([\d.]+) +[\d.]+ +([\d.]+) ", out, re.M)
    assert [r[0] for r in rows] == ["16", "64"] and all(float(x) > 0 for r in rows for x in r[1:])
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG


def test_outcomes_route_reaches_every_follower_and_holds_no_thread_per_poll(tmp_path, capsys, monkeypatch):
    import bench_outcomes

    from sglang_hardened.runtime import outcomes

    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)  # the followers send none
    monkeypatch.setattr(outcomes, "OUTCOMES", outcomes.OUTCOMES)  # the benchmark swaps the log per setting

    bench_outcomes.main(["--followers", "1,3", "--rate", "20", "--seconds", "1", "--plot", str(tmp_path / "h4.png")])
    out = capsys.readouterr().out
    rows = re.findall(r"^(\d+) +\d+ \(([+-]\d+)\) .* (\d+)$", out, re.M)
    # every outcome reached every follower (20 each); the long polls wait on events, not threads
    assert rows == [("1", "+0", "20"), ("3", "+0", "60")]
    assert (tmp_path / "h4.png").read_bytes()[:8] == PNG
