"""Check a base's series without building: headers, listing, and a dry run on upstream."""

from __future__ import annotations

import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import unidiff
from .errors import HardenedError
from .fetch import fetch_wheel
from .lock import get_pin
from .series import load_series


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


def _extract(wheel: Path, names: set[str], root: Path) -> None:
    """Unpack only the files the series touches: a dry run need not unpack 40 MB."""
    with zipfile.ZipFile(wheel) as zf:
        present = set(zf.namelist())
        for name in sorted(names & present):
            zf.extract(name, root)


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
    rows = []
    with tempfile.TemporaryDirectory(prefix="sglang-hardened-verify-") as tmp:
        root = Path(tmp)
        _extract(wheel, touched, root)
        for patch in series.patches:
            try:
                status = _describe(unidiff.apply(root, patch.diff))
            except HardenedError as exc:
                status = f"FAILED: {exc}"
            rows.append(PatchStatus(base, patch.name, patch.hardening_id, status))
    return rows
