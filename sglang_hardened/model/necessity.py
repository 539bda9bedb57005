"""Is each hardening item pulling its weight?

An item is necessary when the fully hardened model with that item alone
turned off breaks a property. An item the model shows redundant must name
its cover in ``configs.COVERED_BY``: then turning it off alone must leave
the model clean, and turning it off together with its cover must not.
Either way a claim in the catalogue is checked, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checker import CheckResult, check
from .configs import ALL, COVERED_BY, SCENARIOS, Config, Switch
from .state import Scenario


@dataclass
class ItemVerdict:
    """What turning one item off does."""

    item: Switch
    alone: CheckResult
    cover: frozenset[Switch]  # empty when the item has no cover
    reason: str
    with_cover: CheckResult | None

    @property
    def holds(self) -> bool:
        """The item is necessary, or its declared cover really covers it."""
        if self.with_cover is None:
            return not self.alone.clean
        return self.alone.clean and not self.with_cover.clean


def _without(items: frozenset[Switch]) -> Config:
    names = ",".join(sorted(items))
    return Config(f"all but {names}", ALL - items, f"every item but {names}", False)


def verdict(item: Switch, scenarios: tuple[Scenario, ...] = SCENARIOS) -> ItemVerdict:
    """Check one item: off alone, and off with its cover if it has one."""
    alone = check(_without(frozenset({item})), scenarios)
    if item not in COVERED_BY:
        return ItemVerdict(item, alone, frozenset(), "", None)
    cover, reason = COVERED_BY[item]
    return ItemVerdict(
        item, alone, cover, reason, check(_without(cover | {item}), scenarios)
    )


def necessity(scenarios: tuple[Scenario, ...] = SCENARIOS) -> list[ItemVerdict]:
    """A verdict for every item, in catalogue order."""
    return [verdict(item, scenarios) for item in sorted(ALL)]
