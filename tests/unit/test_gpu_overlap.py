"""benchmarks/gpu_overlap.py in its degenerate CPU mode, so the prepared GPU check does not rot:
every arm's loop runs and its checks catch the faults; the figures mean nothing here (no
streams, nothing beside the host), and the GPU's await a device (docs/performance.md)."""

from __future__ import annotations

import logging

import pytest

from tests.harness import REPO


@pytest.fixture
def gpu_overlap(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_overlap

    runtime_log = logging.getLogger("sglang_hardened")
    level = runtime_log.level
    yield gpu_overlap
    runtime_log.setLevel(level)  # main() quiets the expected refusals: not for the tests after this one


@pytest.mark.parametrize("barrier", ["forward", "early"])
def test_every_arm_runs_and_the_checking_arms_refuse_exactly_the_unstamped_requests(gpu_overlap, capsys, barrier):
    gpu_overlap.main(["--device", "cpu", "--barrier", barrier, "--layers", "2", "--steps", "6", "--repeats", "2", "--batch", "4", "--hidden", "16",
                      "--prepare-us", "0", "--admit-every", "2", "--pages", "3", "--fault-every", "3"])
    out = capsys.readouterr().out
    assert "CPU: degenerate, measures nothing" in out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert set(rows) == set(gpu_overlap.ARMS)
    # three requests a repeat (steps 0, 2, 4), the third unstamped: refused by both checks, by neither else
    assert rows["upstream"].endswith("0 of 0")
    assert rows["sync"].endswith("2 of 6") and rows["async"].endswith("2 of 6")


def test_help_has_an_example_and_bad_settings_are_refused(gpu_overlap, capsys):
    with pytest.raises(SystemExit):
        gpu_overlap.main(["--help"])
    assert "example: python benchmarks/gpu_overlap.py" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_overlap.main(["--device", "cpu", "--admit-every", "0"])
