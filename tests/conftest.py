"""Shared pytest wiring: per-phase timings and sandbox log tails in failure reports."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

TIMINGS: list[tuple[str, float]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of the run for the summary printed at the end."""
    start = time.monotonic()
    try:
        yield
    finally:
        TIMINGS.append((name, time.monotonic() - start))


def pytest_terminal_summary(terminalreporter) -> None:
    if TIMINGS:
        terminalreporter.section("per-phase times")
        for name, seconds in TIMINGS:
            terminalreporter.write_line(f"{seconds:8.1f}s  {name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    clusters = getattr(item, "sandbox_clusters", [])
    if rep.failed and clusters:
        for c in clusters:
            rep.sections.append((f"sandbox {c.params.base} logs", c.log_tails(60)))
