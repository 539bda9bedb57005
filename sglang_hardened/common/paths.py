"""Where the tool finds its inputs (patches, lock) and keeps its cache."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import HardenedError
from .knobs import CACHE, PATCHES


def cache_dir() -> Path:
    """The user's cache for downloads and environments.

    Outside the checkout on purpose: CI runs in a fresh clone on a machine
    that may keep the user's cache, so a cache in the checkout is always cold.
    """
    override = CACHE.raw()
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sglang-hardened"


def patches_dir() -> Path:
    """The `patches/` tree: the checkout's, unless overridden.

    Building is done from a checkout (the series are its content); an installed
    tool without one must be pointed at a tree with ``PATCHES``.
    """
    override = PATCHES.raw()
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "patches"
    if not (path / "upstream.lock").is_file():
        raise HardenedError(
            f"no patch tree at {path} (expected {path / 'upstream.lock'}); "
            f"run from a sglang-hardened checkout or set {PATCHES.name}"
        )
    return path
