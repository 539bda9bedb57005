"""Download a pinned upstream wheel once, verify it, and serve it from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


def _pip_download(version: str, tags: frozenset, dest: Path, quiet: bool) -> Path:
    """Ask pip for sglang==version built for `tags` (not this interpreter's); the one file."""
    tag = sorted(tags, key=str)[0]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off" if quiet else "on",
        "--python-version", tag.interpreter.removeprefix("cp"),
        "--implementation", "cp", "--abi", tag.abi, "--platform", tag.platform,
        "-d", str(dest), f"sglang=={version}",
    ]
    out = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None,
                         stderr=subprocess.STDOUT if quiet else None, text=True)
    if out.returncode != 0:
        raise HardenedError(
            f"pip could not download sglang=={version} for {tag}: exit {out.returncode}"
            + (f"\n{out.stdout[-2000:]}" if quiet and out.stdout else "")
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


def pin_release(version: str, like: UpstreamPin, *, quiet: bool = True,
                cache: Path | None = None) -> UpstreamPin:
    """Pin a release not yet in the lock: download it for `like`'s tags and record its hash.

    pip checks the hash the index serves with the file, so the pin is what
    the index serves; from then on the lock entry is what every use checks.
    """
    staging = (cache or cache_dir()) / "upstream"
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=staging, prefix=".fetch-") as tmp:
        got = _pip_download(version, like.tags, Path(tmp), quiet)
        pin = UpstreamPin(version, got.name, sha256_file(got))
        os.replace(got, cached_path(pin, cache))
    return pin
