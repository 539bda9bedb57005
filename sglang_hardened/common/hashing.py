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
