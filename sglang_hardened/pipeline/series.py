"""A base's patch series: the quilt-style `series` file and each patch's DEP-3 header."""

from __future__ import annotations

import datetime as dt
import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..common.errors import HardenedError
from ..common.hashing import sha256_file
from .lock import LOCK_NAME

SERIES_NAME = "series"
REQUIRED_FIELDS = ("Description", "Hardening-Id", "Origin", "Forwarded", "Last-Update")
_REVISION = re.compile(r"^#\s*Revision:\s*(\d+)\s*$")
_HARDENING_ID = re.compile(r"^H\d+$")
_DIFF_START = re.compile(r"^(--- |diff |Index: )")


@dataclass(frozen=True)
class Patch:
    """One patch file: its DEP-3 header fields and the diff that follows."""

    path: Path
    headers: dict[str, str]
    diff: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def hardening_id(self) -> str:
        return self.headers["Hardening-Id"]

    @property
    def summary(self) -> str:
        return self.headers["Description"].splitlines()[0]

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.path)


@dataclass(frozen=True)
class Series:
    """A base's ordered patches and its revision (the `N` of `+hardened.N`)."""

    base: str
    directory: Path
    revision: int
    patches: tuple[Patch, ...]

    @property
    def hardening_ids(self) -> list[str]:
        """Distinct ids in catalogue order (H0, H1, …, H10)."""
        return sorted({p.hardening_id for p in self.patches}, key=lambda h: int(h[1:]))

    @property
    def last_update(self) -> dt.date:
        """Newest Last-Update: a deterministic, meaningful build timestamp."""
        return max(dt.date.fromisoformat(p.headers["Last-Update"]) for p in self.patches)


def parse_patch(path: Path) -> Patch:
    """Split a patch into DEP-3 header fields and the diff; check the required fields."""
    label = f"{path.parent.name}/{path.name}"  # base/patch: names the series too
    try:
        text = path.read_text()
    except OSError as exc:
        raise HardenedError(f"cannot read patch {path}: {exc}") from exc
    headers: dict[str, str] = {}
    lines = text.splitlines(keepends=True)
    field = None
    for index, line in enumerate(lines):
        if _DIFF_START.match(line):
            diff = "".join(lines[index:])
            break
        if line[:1] in (" ", "\t") and field:
            headers[field] += "\n" + line.strip()
        elif ":" in line and not line.startswith(" "):
            field, value = line.split(":", 1)
            field = field.strip()
            headers[field] = value.strip()
        else:
            field = None
    else:
        raise HardenedError(f"patch {label}: no diff found after the header")
    missing = [f for f in REQUIRED_FIELDS if not headers.get(f)]
    if missing:
        raise HardenedError(f"patch {label}: header lacks required field(s) {', '.join(missing)}")
    if not _HARDENING_ID.match(headers["Hardening-Id"]):
        raise HardenedError(
            f"patch {label}: Hardening-Id {headers['Hardening-Id']!r} is not of the form H<n>"
        )
    try:
        dt.date.fromisoformat(headers["Last-Update"])
    except ValueError:
        raise HardenedError(
            f"patch {label}: Last-Update {headers['Last-Update']!r} is not YYYY-MM-DD"
        ) from None
    return Patch(path, headers, diff)


def load_series(patches: Path, base: str) -> Series:
    """Read `patches/<base>/series`; every listed file must exist and every patch be listed."""
    directory = patches / base
    series_file = directory / SERIES_NAME
    if not series_file.is_file():
        raise HardenedError(f"base {base}: no series file at {series_file}")
    revision = None
    names: list[str] = []
    for number, raw in enumerate(series_file.read_text().splitlines(), 1):
        line = raw.strip()
        if match := _REVISION.match(line):
            revision = int(match.group(1))
        elif line and not line.startswith("#"):
            names.append(line.split()[0])
    if revision is None:
        raise HardenedError(f"{series_file}: no '# Revision: N' line")
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise HardenedError(f"{series_file} names missing patch file(s): {', '.join(missing)}")
    unlisted = sorted(p.name for p in directory.glob("*.patch") if p.name not in names)
    if unlisted:
        raise HardenedError(f"{directory}: patch file(s) not in the series: {', '.join(unlisted)}")
    if len(set(names)) != len(names):
        raise HardenedError(f"{series_file} lists a patch twice")
    return Series(base, directory, revision, tuple(parse_patch(directory / n) for n in names))


def copy_without(patches: Path, base: str, ids: tuple[str, ...], dest: Path) -> Path:
    """A patch tree at ``dest`` whose ``base`` series leaves out the patches of ``ids``:
    to show what the layers behind a hardening do alone."""
    series = load_series(patches, base)
    unknown = set(ids) - {p.hardening_id for p in series.patches}
    if unknown:
        raise HardenedError(f"{base}'s series has no patch for {', '.join(sorted(unknown))}")
    dropped = {p.name for p in series.patches if p.hardening_id in ids}
    dest.mkdir(parents=True)
    shutil.copy(patches / LOCK_NAME, dest / LOCK_NAME)
    shutil.copytree(patches / base, dest / base, ignore=lambda _dir, names: [n for n in names if n in dropped])
    lines = (patches / base / SERIES_NAME).read_text().splitlines()
    (dest / base / SERIES_NAME).write_text("".join(f"{line}\n" for line in lines if line.strip() not in dropped))
    return dest
