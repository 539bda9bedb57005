"""One exploration per configuration for the whole test session. The model's test modules ask
for the same machines again and again (every hardened base is one machine; upstream 0.5.19,
all-but-H4 and others recur across modules), and each costs seconds of CI."""

from __future__ import annotations

from functools import cache

from sglang_hardened.model.checker import CheckResult
from sglang_hardened.model.checker import check as explore_config
from sglang_hardened.model.configs import SCENARIOS, Agreement, Config, Switch
from sglang_hardened.model.state import Scenario


@cache
def _explored(
    machine: tuple[frozenset[Switch], frozenset[Agreement]], scenarios: tuple[Scenario, ...]
) -> CheckResult:
    switches, agreed = machine
    return explore_config(Config("any", switches, "", False, agreed), scenarios)


def check(config: Config, scenarios: tuple[Scenario, ...] = SCENARIOS) -> CheckResult:
    """``checker.check``, explored once per machine (``Config.machine``) and scenario set."""
    res = _explored(config.machine, scenarios)
    return CheckResult(config, res.results, res.seconds)
