"""A CycloneDX SBOM for the hardened wheel (PEP 770: `.dist-info/sboms/`).

The upstream wheel is the hardened build's ancestor (pedigree), pinned by
hash; each patch is listed with its hash, as CycloneDX models a patched fork.
"""

from __future__ import annotations

import datetime as dt
import uuid

from .manifest import dumps
from .wheelfile import WheelTree

SBOM_FILE = "sboms/sglang-hardened.cdx.json"
SPEC_VERSION = "1.6"
_NAMESPACE = uuid.UUID("1b6f6c55-7a0e-4c1e-9a0f-5f0d1c6a8e21")


def _patch_type(origin: str) -> str:
    return "backport" if origin.lower().startswith("backport") else "unofficial"


def cyclonedx(manifest: dict, epoch: int) -> dict:
    """The SBOM document; serial number and timestamp derive from the inputs."""
    upstream = manifest["upstream"]
    base_ref = f"pkg:pypi/sglang@{manifest['base']}"
    identity = "|".join([manifest["version"], upstream["sha256"]] + [p["sha256"] for p in manifest["patches"]])
    tool = manifest["tool"]
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid5(_NAMESPACE, identity)}",
        "version": 1,
        "metadata": {
            "timestamp": dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tools": {"components": [{"type": "application", "name": tool["name"], "version": tool["version"]}]},
            "component": {
                "type": "library",
                "bom-ref": f"pkg:pypi/sglang@{manifest['version']}",
                "name": "sglang",
                "version": manifest["version"],
                "purl": f"pkg:pypi/sglang@{manifest['version']}",
                "pedigree": {
                    "ancestors": [
                        {
                            "type": "library",
                            "bom-ref": base_ref,
                            "name": "sglang",
                            "version": manifest["base"],
                            "purl": f"{base_ref}?file_name={upstream['file']}",
                            "hashes": [{"alg": "SHA-256", "content": upstream["sha256"]}],
                        }
                    ],
                    "patches": [
                        {
                            "type": _patch_type(p["origin"]),
                            "diff": {"url": f"patches/{manifest['base']}/{p['name']}"},
                        }
                        for p in manifest["patches"]
                    ],
                },
                "properties": [
                    {"name": "sglang-hardened:hardening-id", "value": h} for h in manifest["hardening_ids"]
                ],
            },
        },
        "components": [
            {
                "type": "file",
                "bom-ref": f"patch:{p['name']}",
                "name": p["name"],
                "description": f"{p['hardening_id']}: {p['summary']}",
                "hashes": [{"alg": "SHA-256", "content": p["sha256"]}],
            }
            for p in manifest["patches"]
        ],
    }


def write_sbom(tree: WheelTree, manifest: dict, epoch: int) -> None:
    path = tree.dist_info / SBOM_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(cyclonedx(manifest, epoch)))
