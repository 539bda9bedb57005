"""Download a pinned upstream wheel once, verify it, and serve it from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.tags import parse_tag

from ..common.errors import HardenedError
from ..common.hashing import sha256_file
from ..common.paths import cache_dir
from .lock import UpstreamPin


def cached_path(pin: UpstreamPin, cache: Path | None = None) -> Path:
    """Where the verified wheel for `pin` lives in the cache."""
    return (cache or cache_dir()) / "upstream" / pin.file


def verify_wheel(pin: UpstreamPin, path: Path) -> None:
    """Refuse a wheel whose sha256 differs from the pin (tampered or corrupt)."""
    actual = sha256_file(path)
    if actual != pin.sha256:
        raise HardenedError(
            f"sha256 mismatch for {path}: expected {pin.sha256} (patches/upstream.lock), "
            f"got {actual}; the file is corrupt or tampered with "
            f"(run `sglang-hardened fetch --base {pin.base} --refresh` to download it again)"
        )


NOT_SHIPPED = "No matching distribution found"  # pip's words when the index has no such wheel...
UNREACHABLE = ("Retrying", "NewConnectionError", "Could not fetch URL", "ConnectTimeout")  # ...or could not ask


def _pip_download(version: str, tags: frozenset, dest: Path, quiet: bool, missing_ok: bool = False) -> Path | None:
    """Ask pip for sglang==version built for `tags` (not this interpreter's); the one file, or
    None when `missing_ok` and the index serves no wheel for those tags."""
    tag = sorted(tags, key=str)[0]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off" if quiet else "on",
        "--python-version", tag.interpreter.removeprefix("cp"),
        "--implementation", "cp", "--abi", tag.abi, "--platform", tag.platform,
        "-d", str(dest), f"sglang=={version}",
    ]
    out = subprocess.run(cmd, stdout=subprocess.PIPE if quiet or missing_ok else None,
                         stderr=subprocess.STDOUT if quiet or missing_ok else None, text=True)
    if out.returncode != 0:
        said = out.stdout or ""
        if missing_ok and NOT_SHIPPED in said and not any(word in said for word in UNREACHABLE):
            return None
        raise HardenedError(
            f"pip could not download sglang=={version} for {tag}: exit {out.returncode}"
            + (f"\n{out.stdout[-2000:]}" if out.stdout else "")
        )
    [got] = list(dest.iterdir())
    return got


def fetch_wheel(pin: UpstreamPin, *, refresh: bool = False, quiet: bool = True,
                cache: Path | None = None) -> Path:
    """The verified upstream wheel for `pin`, downloading it on a cold cache.

    A cached copy is re-verified on every use: the cache is outside the
    checkout and must not be trusted blindly. A bad copy is an error, not a
    silent re-download, unless `refresh` asks for one.
    """
    target = cached_path(pin, cache)
    if target.is_file() and not refresh:
        verify_wheel(pin, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        got = _pip_download(pin.base, pin.tags, Path(tmp), quiet)
        if got.name != pin.file:
            raise HardenedError(f"pip downloaded {got.name}, not the pinned {pin.file}")
        verify_wheel(pin, got)
        os.replace(got, target)
    return target


# The wheels upstream may ship for a release besides its reference: each CPython and machine
# on the reference's manylinux level (0.5.19-0.5.21 ship cp310-cp313, 0.5.22 on cp311-cp313).
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
ARCHES = ("x86_64", "aarch64")


def _candidates(like: UpstreamPin) -> list[frozenset]:
    """Tags of every wheel to ask the index for, the reference's first."""
    level = max(t.platform for t in like.tags if t.platform.startswith("manylinux_")).removesuffix(f"_{like.arch}")
    ref = sorted(like.tags, key=str)[0]
    others = [parse_tag(f"cp{py.replace('.', '')}-cp{py.replace('.', '')}-{level}_{arch}")
              for py in PYTHONS for arch in ARCHES]
    return [like.tags, *(t for t in others if ref not in t)]


def pin_release(version: str, like: UpstreamPin, *, quiet: bool = True,
                cache: Path | None = None) -> list[UpstreamPin]:
    """Pin a release not yet in the lock: every wheel the index serves for it, the one for
    `like`'s tags first (the reference), each downloaded and its hash recorded.

    pip checks the hash the index serves with the file, so the pin is what
    the index serves; from then on the lock entry is what every use checks.
    """
    staging = (cache or cache_dir()) / "upstream"
    staging.mkdir(parents=True, exist_ok=True)
    pins = []
    for i, tags in enumerate(_candidates(like)):
        with tempfile.TemporaryDirectory(dir=staging, prefix=".fetch-") as tmp:
            got = _pip_download(version, tags, Path(tmp), quiet, missing_ok=i > 0)
            if got is None:
                continue
            pin = UpstreamPin(version, got.name, sha256_file(got))
            os.replace(got, cached_path(pin, cache))
            pins.append(pin)
    return pins
