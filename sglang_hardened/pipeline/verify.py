"""Check a base's series without building: headers, listing, the seam rule, and a dry run on upstream."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.errors import HardenedError
from . import seams, unidiff
from .fetch import fetch_wheel
from .lock import get_pin
from .series import load_series
from .wheelfile import read_members


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


def verify_base(patches: Path, base: str) -> list[PatchStatus]:
    """Rows for one base; a series-level fault is one failed row naming it."""
    try:
        pin = get_pin(patches, base)
        series = load_series(patches, base)
        wheel = fetch_wheel(pin)
    except HardenedError as exc:
        return [PatchStatus(base, "(series)", "-", f"FAILED: {exc}")]
    touched = {fp.target for p in series.patches for fp in unidiff.parse(p.diff)}
    files = read_members(wheel, touched)  # a dry run need not unpack 40 MB
    rows = []
    for patch in series.patches:
        try:
            files, results = unidiff.apply_to_files(files, patch.diff)
            status = _describe(results)
        except HardenedError as exc:
            status = f"FAILED: {exc}"
        if status.startswith("ok") and (glue := seams.over_budget(patch.headers["Origin"], patch.diff)):
            status = "FAILED: more than the seam rule allows besides runtime calls " + "; ".join(
                f"({len(lines)} > {seams.GLUE_LINES_MAX} lines in {path}: {', '.join(lines[:4])})"
                for path, lines in glue.items())
        rows.append(PatchStatus(base, patch.name, patch.hardening_id, status))
    return rows
