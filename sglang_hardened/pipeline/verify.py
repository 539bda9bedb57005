"""Check a base's series without building: headers, listing, the seam rule, and a dry run on upstream."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.errors import HardenedError
from . import seams, unidiff
from .fetch import fetch_wheel
from .lock import UpstreamPin, get_wheels
from .series import load_series
from .wheelfile import python_sources, read_members


@dataclass(frozen=True)
class PatchStatus:
    """One row of `verify`'s table."""

    base: str
    patch: str
    hardening_id: str
    status: str

    @property
    def ok(self) -> bool:
        return self.status.startswith("ok")


def _describe(results: list[unidiff.FileResult]) -> str:
    if any(r.already_applied for r in results):
        return "FAILED: already applied upstream"
    offsets = [o for r in results for o in r.offsets if o]
    return f"ok (offset {', '.join(map(str, offsets))})" if offsets else "ok"


def same_sources(pins: list[UpstreamPin], wheels: list[Path]) -> str:
    """Whether every wheel of a base holds the reference's Python sources, byte for byte (by
    RECORD): the series is checked on the reference and applied to all of them."""
    reference = python_sources(wheels[0])
    for pin, wheel in zip(pins[1:], wheels[1:]):
        if (other := python_sources(wheel)) != reference:
            differ = sorted(n for n in reference.keys() | other.keys() if reference.get(n) != other.get(n))
            return f"FAILED: {pin.file} differs from {pins[0].file} in {len(differ)} sources: {', '.join(differ[:3])}"
    return "ok (identical)"


def verify_base(patches: Path, base: str) -> list[PatchStatus]:
    """Rows for one base; a series-level fault is one failed row naming it."""
    return verify_and_index(patches, base)[0]


def verify_and_index(patches: Path, base: str) -> tuple[list[PatchStatus], list[seams.Site]]:
    """``verify_base``'s rows, and the base's seams as its patches apply (docs/seams.md)."""
    try:
        pins = get_wheels(patches, base)
        series = load_series(patches, base)
        wheels = [fetch_wheel(pin) for pin in pins]
    except HardenedError as exc:
        return [PatchStatus(base, "(series)", "-", f"FAILED: {exc}")], []
    touched = {fp.target for p in series.patches for fp in unidiff.parse(p.diff)}
    files = read_members(wheels[0], touched)  # a dry run need not unpack 40 MB
    rows = [PatchStatus(base, f"(sources of {len(pins)} wheels)", "-", same_sources(pins, wheels))]
    index = seams.SiteIndex()
    for patch in series.patches:
        try:
            files, results = unidiff.apply_to_files(files, patch.diff)
            status = _describe(results)
            index.add(patch.name.removesuffix(".patch"), patch.diff, files)
        except HardenedError as exc:
            status = f"FAILED: {exc}"
        if status.startswith("ok") and (aliases := seams.alias_faults(patch.diff)):
            first = len(patch.path.read_text().splitlines()) - len(patch.diff.splitlines())  # the header's lines
            status = "FAILED: an import breaks the seam rule's one alias per module: " + "; ".join(
                f"line {first + number}: {fault}" for number, fault in aliases)
        if status.startswith("ok") and (glue := seams.over_budget(patch.headers["Origin"], patch.diff, index.aliases)):
            status = "FAILED: more than the seam rule allows besides runtime calls " + "; ".join(
                f"({len(lines)} > {seams.GLUE_LINES_MAX} lines in {path}: {', '.join(lines[:4])})"
                for path, lines in glue.items())
        rows.append(PatchStatus(base, patch.name, patch.hardening_id, status))
    return rows, index.sites
