"""The pinned upstream wheels (`patches/upstream.lock`), the one source of their hashes."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from ..common.errors import HardenedError

LOCK_NAME = "upstream.lock"


@dataclass(frozen=True)
class UpstreamPin:
    """One upstream release as the package index serves it."""

    base: str
    file: str
    sha256: str

    @property
    def tags(self) -> frozenset:
        """Wheel tags from the pinned file name (what `pip download` must ask for)."""
        return parse_wheel_filename(self.file)[3]


def load_lock(patches: Path) -> dict[str, UpstreamPin]:
    """Every supported base, in version order."""
    path = patches / LOCK_NAME
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HardenedError(f"cannot read {path}: {exc}") from exc
    pins = {}
    for base, entry in data.get("base", {}).items():
        missing = {"file", "sha256"} - entry.keys()
        if missing:
            raise HardenedError(f"{path}: base {base} lacks {', '.join(sorted(missing))}")
        pins[base] = UpstreamPin(base, entry["file"], entry["sha256"].lower())
    return dict(sorted(pins.items(), key=lambda kv: Version(kv[0])))


def get_pin(patches: Path, base: str) -> UpstreamPin:
    """The pin for `base`, or an error listing the supported bases."""
    pins = load_lock(patches)
    if base not in pins:
        raise HardenedError(f"unknown base {base!r}; supported bases: {', '.join(pins)}")
    return pins[base]


def add_pin(patches: Path, pin: UpstreamPin) -> None:
    """Append a base to the lock file (kept hand-readable: one block per base, in order)."""
    path = patches / LOCK_NAME
    if pin.base in load_lock(patches):
        raise HardenedError(f"{path} already pins {pin.base}")
    block = f'\n[base."{pin.base}"]\nfile = "{pin.file}"\nsha256 = "{pin.sha256}"\n'
    with path.open("a") as fh:
        fh.write(block)
