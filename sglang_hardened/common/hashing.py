"""File digests in the two forms the pipeline needs (hex for pins, RECORD's base64)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (wheels are tens of MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_digest(data: bytes) -> str:
    """The `sha256=<urlsafe base64, no padding>` form that wheel RECORD files use."""
    raw = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def files_digest(root: Path, paths: list[Path]) -> str:
    """Hex sha256 over ``paths`` (relative names and contents, in sorted order) under ``root``:
    one key for a set of inputs, which a rename changes as an edit does."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
