"""What the package index offers beyond the newest supported base."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from ..common.errors import HardenedError
from .lock import load_lock


def index_versions() -> list[Version]:
    """Every sglang release the index lists (pip's own view of the index, same config as fetch)."""
    run = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang",
                          "--disable-pip-version-check"], capture_output=True, text=True)
    match = re.search(r"^Available versions: (.+)$", run.stdout, re.M)
    if run.returncode != 0 or not match:
        raise HardenedError(f"could not list sglang releases: {(run.stderr or run.stdout).strip()[-500:]}")
    return [Version(v.strip()) for v in match.group(1).split(",")]


def newer_releases(patches: Path, available: list[Version] | None = None) -> list[str]:
    """Final releases newer than the newest supported base, oldest first."""
    newest = max(Version(b) for b in load_lock(patches))
    found = index_versions() if available is None else available
    return [str(v) for v in sorted(found) if v > newest and not v.is_prerelease]
