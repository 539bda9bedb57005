"""The hardening policy file (`policy.yaml`): which knobs apply to which base, the numbers the
runtime reads, and the defaults of the ``SGLANG_HARDENED_*`` variables that override them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ..common.errors import HardenedError
from ..common import knobs
from ..common.knobs import KNOBS, Limit
from ..common.table import markdown_table

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


def load_limits(item: str) -> dict[str, int | float]:
    """The numbers the runtime layer uses for one item of ``limits`` (a hardening id, or a number
    several share, such as ``release_timeout``): its defaults."""
    return dict(_policy_file()["limits"][item])


def limit(ref: Limit) -> int | float:
    """The number a ``Limit`` names."""
    return load_limits(ref.item)[ref.key]


def knob_value(knob: knobs.Knob, environ: Mapping[str, str] = os.environ):
    """A knob's value in this environment, its default read from ``limits`` where the policy owns it."""
    return knob.get(environ, limit(knob.default) if isinstance(knob.default, Limit) else None)


KNOB_COLUMNS = ("variable", "type", "default", "id", "role", "weakens a guarantee", "what it does")


def knob_rows() -> list[tuple[str, ...]]:
    """One row per ``SGLANG_HARDENED_*`` variable, defaults resolved: what `policy knobs` prints
    and docs/operating.md carries."""
    def default(knob: knobs.Knob) -> str:
        if isinstance(knob.default, Limit):
            return f"{limit(knob.default)} ({knob.default})"
        return "unset" if knob.default is None else str(knob.default)

    return [(k.name, k.type, default(k), k.id or "-", k.role, "yes" if k.weakens else "no", k.doc) for k in KNOBS]


def knobs_markdown() -> str:
    """The knob table as docs/operating.md carries it (`policy knobs --markdown`)."""
    return markdown_table(KNOB_COLUMNS, [(f"`{name}`", *rest) for name, *rest in knob_rows()])


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
