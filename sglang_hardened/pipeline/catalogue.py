"""``patches/hardening.toml``: the hardening ids, one table each, in one machine-readable list.

Everything else that names the ids is checked against it: each patch's ``Hardening-Id``, the
README's table, docs/hardening.md's headings and header tables, the protocol model's switches,
the metrics' refusal ids and the claims the landing gate shows (tests/unit/test_catalogue.py).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import HardenedError
from ..common.table import markdown_table

CATALOGUE_FILE = "hardening.toml"


@dataclass(frozen=True)
class Item:
    """One hardening id (the file's header comment says what each field holds)."""

    id: str
    title: str
    bases: tuple[str, ...]
    patches: tuple[str, ...]
    runtime: tuple[str, ...]
    knobs: tuple[str, ...]
    upstream: str
    hardened: str
    modelled: bool
    refuses: bool


def load_catalogue(patches: Path) -> list[Item]:
    """The ids in the file's order (H0, H1, ...)."""
    path = patches / CATALOGUE_FILE
    try:
        data = tomllib.loads(path.read_text())
        return [Item(id=hid, **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
                for hid, fields in data.items()]
    except (OSError, tomllib.TOMLDecodeError, TypeError) as e:
        raise HardenedError(f"{path}: {e}") from None


def _span(bases: tuple[str, ...], supported: list[str]) -> str:
    """``0.5.19-0.5.23`` for a run of the supported bases, else the list."""
    if not bases:
        return "-"
    start = supported.index(bases[0])
    if list(bases) == supported[start:start + len(bases)] and len(bases) > 1:
        return f"{bases[0]}-{bases[-1]}"
    return ", ".join(bases)


def header_table(item: Item, supported: list[str]) -> str:
    """The table docs/hardening.md opens each id's entry with."""
    def code(values: tuple[str, ...]) -> str:
        return ", ".join(f"`{v}`" for v in values) or "-"

    return markdown_table(("", ""), [
        ("bases", _span(item.bases, supported)),
        ("patches", code(item.patches)),
        ("runtime", code(item.runtime)),
        ("knobs", code(item.knobs)),
        ("upstream fails", f"`{item.upstream}`"),
        ("hardened holds", f"`{item.hardened}`"),
    ])
