"""Is each hardening item pulling its weight, with one rank per role and with two?

An item is necessary when the fully hardened model with that item alone
turned off breaks a property. An item the model shows redundant must name
its cover in ``configs.COVERED_BY``: then turning it off alone must leave
the model clean, and turning it off together with its cover must not.
Either way a claim in the catalogue is checked, not assumed.

Each result is also split by the scenarios' rank count, which says what a
second rank makes necessary: the agreements (``configs.Agreement``) are no-ops
with one rank and must break the model when dropped with two.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checker import CheckResult, check
from .configs import AGREED, ALL, COVERED_BY, SCENARIOS, Agreement, Config, Switch
from .state import Scenario


def kinds_at(result: CheckResult, ranks: int) -> list[str]:
    """Broken properties in the scenarios with ``ranks`` ranks per role, the leak first."""
    order = {kind: i for i, kind in enumerate(result.kinds)}
    found = {f.kind for r in result.results if r.scenario.ranks == ranks for f in r.findings}
    return sorted(found, key=order.__getitem__)


@dataclass
class ItemVerdict:
    """What turning one item (or one agreement) off does."""

    item: Switch | Agreement
    alone: CheckResult
    cover: frozenset[Switch]  # empty when the item has no cover
    reason: str
    with_cover: CheckResult | None

    @property
    def holds(self) -> bool:
        """The item is necessary, or its declared cover really covers it; an agreement is
        a no-op with one rank and necessary with two."""
        if isinstance(self.item, Agreement):
            return not kinds_at(self.alone, 1) and bool(kinds_at(self.alone, 2))
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


def agreement_verdict(
    agreement: Agreement, scenarios: tuple[Scenario, ...] = SCENARIOS
) -> ItemVerdict:
    """Check one agreement: every item on, that one decision taken per rank."""
    config = Config(
        f"all but {agreement.value} agreement", ALL, "", False, AGREED - {agreement}
    )
    return ItemVerdict(agreement, check(config, scenarios), frozenset(), "", None)


def necessity(scenarios: tuple[Scenario, ...] = SCENARIOS) -> list[ItemVerdict]:
    """A verdict for every item in catalogue order, then for every agreement."""
    items = [verdict(item, scenarios) for item in sorted(ALL)]
    return items + [agreement_verdict(a, scenarios) for a in Agreement]
