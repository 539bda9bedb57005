"""The one report every benchmark prints: the measured thing against its floor, same run."""

from __future__ import annotations

import statistics

from sglang_hardened.common.table import format_table


def print_against_floor(floor_label: str, floors: list[float], label: str, runs: list[float],
                        ratio_label: str, note: str, digits: int = 2) -> None:
    """Medians of both, every run, and the ratio of the medians."""
    f, r = statistics.median(floors), statistics.median(runs)
    print(format_table(("what", "median s", "runs"), [
        (floor_label, f"{f:.{digits}f}", " ".join(f"{x:.{digits}f}" for x in floors)),
        (label, f"{r:.{digits}f}", " ".join(f"{x:.{digits}f}" for x in runs)),
        (ratio_label, f"{r / f:.2f}", note),
    ]))
