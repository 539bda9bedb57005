"""Render junit XML of tests/e2e/test_oversized.py runs as the matrix table in docs/e2e-matrix.md."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from sglang_hardened.common.table import format_table

_CASE = re.compile(r"^(test_\w+)\[(0\.5\.\d+)-(\w+)\]$")


def outcomes(junit: Path) -> dict[tuple[str, str, str], str]:
    """(test, base, backend) -> 'pass (Ns)' / 'FAIL (Ns)' / 'skip' for each parametrised case."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        m = _CASE.match(case.get("name", ""))
        if not m:
            continue
        seconds = float(case.get("time", 0))
        if case.find("skipped") is not None:
            verdict = "skip"
        elif case.find("failure") is not None or case.find("error") is not None:
            verdict = f"FAIL ({seconds:.0f}s)"
        else:
            verdict = f"pass ({seconds:.0f}s)"
        found[m.groups()] = verdict
    return found


def render(found: dict[tuple[str, str, str], str], commit: str) -> str:
    """One row per base and backend, one numbered column per scenario (legend below)."""
    pairs = sorted({(base, backend) for _, base, backend in found})
    tests = sorted({test for test, _, _ in found})
    rows = [[f"{b} {k}"] + [found.get((test, b, k), "-") for test in tests] for b, k in pairs]
    table = format_table(["base backend"] + [str(i) for i in range(1, len(tests) + 1)], rows)
    legend = "\n".join(f"{i}. `{test}`" for i, test in enumerate(tests, 1))
    return (f"# Oversized-prompt scenarios: the full matrix\n\n"
            f"Last full run: {dt.date.today()}, commit {commit}, `scripts/e2e-matrix` (CI runs every scenario "
            f"on 0.5.19 and 0.5.23 with Mooncake and one on 0.5.20; `-`: the "
            f"scenario does not apply there).\n\n```\n{table}\n```\n\n{legend}\n")


if __name__ == "__main__":
    # matrix_report.py OUT JUNIT... : a later run's result for a case replaces an earlier one's
    out, *junits = map(Path, sys.argv[1:])
    found: dict[tuple[str, str, str], str] = {}
    for junit in junits:
        found.update(outcomes(junit))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.write_text(render(found, commit or "unknown"))
    print(out.read_text())
