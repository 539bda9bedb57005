"""The hardening policy file (`policy.yaml`): which knobs apply to which base."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..common.errors import HardenedError

PD_MODES = ("prefill", "decode")


@dataclass(frozen=True)
class Knob:
    """One default: an env var with a value, or a flag; what it serves and why."""

    id: str
    bases: SpecifierSet
    why: str
    env: str | None = None
    value: str | None = None
    flag: str | None = None
    pd_only: bool = False

    @property
    def name(self) -> str:
        return self.env or self.flag or ""

    def applies(self, base: str) -> bool:
        return Version(base) in self.bases


def _policy_file() -> dict:
    return yaml.safe_load(resources.files(__package__).joinpath("policy.yaml").read_text())


def load_limits(hardening_id: str) -> dict[str, int | float]:
    """The numbers the runtime layer uses for one hardening id (its defaults)."""
    return dict(_policy_file()["limits"][hardening_id])


def load_policy() -> list[Knob]:
    """Every knob in the shipped policy file."""
    knobs = []
    for entry in _policy_file()["knobs"]:
        entry = dict(entry, bases=SpecifierSet(entry["bases"]))
        if "value" in entry:  # a number taken from `limits` by reference is still an env value
            entry["value"] = str(entry["value"])
        knob = Knob(**entry)
        if bool(knob.env) == bool(knob.flag) or (knob.env and knob.value is None):
            raise HardenedError(f"policy knob {knob.id}: give either env + value or flag")
        knobs.append(knob)
    return knobs


def knobs_for(base: str) -> list[Knob]:
    """The knobs that apply to `base`."""
    try:
        Version(base)
    except InvalidVersion:
        raise HardenedError(f"{base!r} is not a release version (e.g. 0.5.23)") from None
    return [k for k in load_policy() if k.applies(base)]
