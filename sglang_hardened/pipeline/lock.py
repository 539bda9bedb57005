"""The pinned upstream wheels (`patches/upstream.lock`), the one source of their hashes.

Upstream ships one wheel per CPython tag and architecture, each with its own compiled
extensions and the same Python sources. Each base pins its reference wheel (``file``, cp311
x86_64, which the sandbox runs by default) and every other wheel it ships (``also``, which the
sandbox runs under another Python); the build hardens each from the same series."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
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

    @property
    def python(self) -> str:
        """The CPython tag the wheel is built for, e.g. ``cp312``."""
        return sorted(t.interpreter for t in self.tags)[0]

    @property
    def arch(self) -> str:
        """The machine the wheel is built for, e.g. ``x86_64`` or ``aarch64``."""
        platforms = sorted({t.platform for t in self.tags})
        found = {m.group(1) for p in platforms if (m := re.fullmatch(r"(?:(?:many|musl)linux_\d+_\d+|manylinux\d+)_(.+)", p))}
        return found.pop() if len(found) == 1 else platforms[0]

    @property
    def runs_on(self) -> str:
        """The Python and machine the wheel is for, as a node reports what it runs: ``cp312 x86_64``."""
        return f"{self.python} {self.arch}"


def _read(patches: Path) -> tuple[Path, dict]:
    path = patches / LOCK_NAME
    try:
        return path, tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HardenedError(f"cannot read {path}: {exc}") from exc


def _pin(path: Path, base: str, entry: dict) -> UpstreamPin:
    missing = {"file", "sha256"} - entry.keys()
    if missing:
        raise HardenedError(f"{path}: base {base} lacks {', '.join(sorted(missing))}")
    try:
        name, version = parse_wheel_filename(entry["file"])[:2]
    except InvalidWheelFilename as exc:
        raise HardenedError(f"{path}: base {base}: {exc}") from exc
    if name != "sglang" or str(version) != base:
        raise HardenedError(f"{path}: base {base} pins {entry['file']}, a wheel of {name} {version}")
    return UpstreamPin(base, entry["file"], entry["sha256"].lower())


def load_wheels(patches: Path) -> dict[str, list[UpstreamPin]]:
    """Every supported base's wheels, reference first, bases in version order."""
    path, data = _read(patches)
    wheels = {}
    for base, entry in data.get("base", {}).items():
        pins = [_pin(path, base, entry), *(_pin(path, base, also) for also in entry.get("also", []))]
        seen = [(p.python, p.arch) for p in pins]
        if len(set(seen)) != len(seen):
            raise HardenedError(f"{path}: base {base} pins two wheels for one Python and architecture")
        wheels[base] = pins
    return dict(sorted(wheels.items(), key=lambda kv: Version(kv[0])))


def load_lock(patches: Path) -> dict[str, UpstreamPin]:
    """Every supported base's reference wheel, in version order."""
    return {base: pins[0] for base, pins in load_wheels(patches).items()}


def get_pin(patches: Path, base: str) -> UpstreamPin:
    """The reference pin for `base`, or an error listing the supported bases."""
    return get_wheels(patches, base)[0]


def get_wheels(patches: Path, base: str) -> list[UpstreamPin]:
    """Every pinned wheel of `base`, reference first, or an error listing the supported bases."""
    wheels = load_wheels(patches)
    if base not in wheels:
        raise HardenedError(f"unknown base {base!r}; supported bases: {', '.join(wheels)}")
    return wheels[base]


def pin_for(pins: list[UpstreamPin], runs_on: str) -> UpstreamPin:
    """The one of a base's ``pins`` built for ``runs_on`` (``cp312 x86_64``), or an error naming those it has."""
    for pin in pins:
        if pin.runs_on == runs_on:
            return pin
    raise HardenedError(f"upstream ships no sglang {pins[0].base} wheel for {runs_on} (it ships: "
                        f"{', '.join(p.runs_on for p in pins)})")


def lock_block(pins: list[UpstreamPin]) -> str:
    """One base's block of the lock file, hand-readable: the reference, then the others."""
    ref, *others = pins
    also = "".join(f'    {{ file = "{p.file}", sha256 = "{p.sha256}" }},\n' for p in others)
    return (f'\n[base."{ref.base}"]\nfile = "{ref.file}"\nsha256 = "{ref.sha256}"\n'
            + (f"also = [\n{also}]\n" if others else ""))


def add_pin(patches: Path, pins: list[UpstreamPin]) -> None:
    """Append a base's wheels (reference first) to the lock file."""
    path = patches / LOCK_NAME
    if pins[0].base in load_lock(patches):
        raise HardenedError(f"{path} already pins {pins[0].base}")
    with path.open("a") as fh:
        fh.write(lock_block(pins))
