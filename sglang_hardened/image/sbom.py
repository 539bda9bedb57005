"""The image's CycloneDX SBOM, made at build time from what the built image holds (its OS,
Debian packages, which carry CUDA's on upstream's base, and Python distributions, read by
inventory.py inside it). The hardened sglang in it points at the wheel's own SBOM (its
upstream ancestor and every patch, pipeline/sbom.py) by a CycloneDX BOM-Link, not a copy.
"""

from __future__ import annotations

import json
import re
import uuid
import zipfile
from pathlib import Path
from urllib.parse import quote

from .. import __version__
from ..common.errors import HardenedError
from ..common.hashing import sha256_file
from ..pipeline.sbom import SBOM_FILE, SPEC_VERSION

_NAMESPACE = uuid.UUID("6b0f3d1e-2f4a-4c55-9c1e-8a7d1c2b9e40")


def wheel_sbom_link(wheel: Path) -> str:
    """The BOM-Link (``urn:cdx:<serial>/<version>``) of the SBOM a hardened wheel carries."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(f".dist-info/{SBOM_FILE}")]
        if len(names) != 1:
            raise HardenedError(f"{wheel.name} carries no {SBOM_FILE}")
        bom = json.loads(zf.read(names[0]))
    return f"urn:cdx:{bom['serialNumber'].removeprefix('urn:uuid:')}/{bom['version']}"


def _pypi_purl(name: str, version: str) -> str:
    return f"pkg:pypi/{re.sub(r'[-_.]+', '-', name).lower()}@{quote(version, safe='')}"


def _deb_purl(os: dict[str, str], pkg: dict[str, str]) -> str:
    distro = os.get("ID", "debian")
    return (f"pkg:deb/{distro}/{pkg['name']}@{quote(pkg['version'], safe='')}?arch={pkg['arch']}"
            f"&distro={distro}-{os.get('VERSION_ID', '')}")


def image_sbom(inventory: dict, *, tag: str, image_id: str, created: str, base_image: str, base_digest: str | None,
               wheels: dict[str, Path]) -> dict:
    """The SBOM of the image ``tag`` (``image_id``) from its ``inventory``; ``wheels`` maps
    a distribution's name (``sglang``, ``sglang-hardened``) to the wheel the build installed
    for it, whose sha256 the component then carries (and, for sglang, the link to its SBOM)."""
    os = inventory["os"]
    components: list[dict] = [{"type": "operating-system", "bom-ref": "os", "name": os.get("ID", "unknown"),
                               "version": os.get("VERSION_ID", ""), "description": os.get("PRETTY_NAME", "")}]
    components += [{"type": "library", "bom-ref": purl, "name": pkg["name"], "version": pkg["version"], "purl": purl}
                   for pkg in inventory["debian"] for purl in [_deb_purl(os, pkg)]]
    for dist in inventory["pypi"]:
        purl = _pypi_purl(dist["name"], dist["version"])
        component = {"type": "library", "bom-ref": purl, "name": dist["name"], "version": dist["version"], "purl": purl}
        wheel = wheels.get(dist["name"].lower())
        if wheel is not None:
            component["hashes"] = [{"alg": "SHA-256", "content": sha256_file(wheel)}]
            component["properties"] = [{"name": "sglang-hardened:wheel", "value": wheel.name}]
            if dist["name"].lower() == "sglang":
                component["externalReferences"] = [{"type": "bom", "url": wheel_sbom_link(wheel),
                                                    "comment": f"the wheel's own SBOM ({SBOM_FILE} in it)"}]
        components.append(component)
    name, _, version = tag.rpartition(":")
    base = {"type": "container", "bom-ref": "base-image", "name": base_image}
    if base_digest:
        base["version"] = base_digest
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid5(_NAMESPACE, image_id)}",
        "version": 1,
        "metadata": {
            "timestamp": created,
            "tools": {"components": [{"type": "application", "name": "sglang-hardened", "version": __version__}]},
            "component": {"type": "container", "bom-ref": "image", "name": name or tag, "version": version,
                          "properties": [{"name": "sglang-hardened:image-id", "value": image_id},
                                         {"name": "sglang-hardened:python", "value": inventory["python"]}],
                          "pedigree": {"ancestors": [base]}},
        },
        "components": components,
        "dependencies": [{"ref": "image", "dependsOn": [c["bom-ref"] for c in components]}],
    }
