"""What a hardened wheel carries, written into its dist-info at build time."""

from __future__ import annotations

import json

from .. import __version__
from ..runtime.identity import MANIFEST_NAME
from .lock import UpstreamPin
from .series import Series
from .stamp import TOOL_DIST
from .wheelfile import WheelTree

SCHEMA = 1


def build_manifest(pin: UpstreamPin, series: Series, version: str) -> dict:
    """The manifest: upstream wheel, each patch with its hash and id, the tool version."""
    return {
        "schema": SCHEMA,
        "distribution": "sglang",
        "version": version,
        "base": series.base,
        "revision": series.revision,
        "upstream": {"file": pin.file, "sha256": pin.sha256},
        "hardening_ids": series.hardening_ids,
        "patches": [
            {
                "name": p.name,
                "sha256": p.sha256,
                "hardening_id": p.hardening_id,
                "summary": p.summary,
                "origin": p.headers["Origin"],
            }
            for p in series.patches
        ],
        "tool": {"name": TOOL_DIST, "version": __version__},
    }


def dumps(document: dict) -> str:
    """Deterministic JSON (sorted keys, fixed layout) so rebuilds are byte-identical."""
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_manifest(tree: WheelTree, manifest: dict) -> None:
    (tree.dist_info / MANIFEST_NAME).write_text(dumps(manifest))
