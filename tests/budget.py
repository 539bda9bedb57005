"""The suite's budget (tests/budget.toml) and the check a whole-suite run ends with."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

BUDGET_FILE = Path(__file__).with_name("budget.toml")
STARTED_ENV = "SGLANG_HARDENED_SUITE_STARTED"  # scripts/test sets it (epoch seconds) for a whole-suite run


@dataclass(frozen=True)
class Spent:
    """What a run used, in the units of tests/budget.toml."""

    run_seconds: float
    setup_seconds: float
    cluster_starts: int
    server_restarts: int


def load_budget(path: Path = BUDGET_FILE) -> Spent:
    data = tomllib.loads(path.read_text())
    names = {f.name for f in fields(Spent)}
    if set(data) != names:
        raise ValueError(f"{path}: wants exactly {sorted(names)}, has {sorted(data)}")
    return Spent(**data)


def overruns(spent: Spent, budget: Spent) -> list[str]:
    """One line per budget line ``spent`` exceeds (none: within budget)."""
    return [f"{f.name}: {getattr(spent, f.name):g} over the budget of {getattr(budget, f.name):g} ({BUDGET_FILE.name})"
            for f in fields(Spent) if getattr(spent, f.name) > getattr(budget, f.name)]
