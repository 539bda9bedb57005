"""Give an unpacked upstream wheel its hardened identity: version and dependency."""

from __future__ import annotations

import re

from ..common.errors import HardenedError
from .wheelfile import WheelTree

TOOL_DIST = "sglang-hardened"
VERSION_FILE = "sglang/_version.py"
_VERSION_LINE = re.compile(r"^(__version__ = version = )'([^']+)'$", re.M)


def hardened_version(base: str, revision: int) -> str:
    """`<upstream>+hardened.<n>`: a PEP 440 local version, compatible with upstream's."""
    return f"{base}+hardened.{revision}"


def stamp_version_module(tree: WheelTree, base: str, version: str) -> None:
    """Make `sglang.__version__` report the hardened version (setuptools-scm's file)."""
    path = tree.root / VERSION_FILE
    text = path.read_text()
    found = _VERSION_LINE.findall(text)
    if len(found) != 1 or found[0][1] != base:
        raise HardenedError(
            f"{VERSION_FILE}: expected one line `__version__ = version = '{base}'`, "
            f"found {[f[1] for f in found]}"
        )
    path.write_text(_VERSION_LINE.sub(lambda m: f"{m.group(1)}'{version}'", text))


def stamp_metadata(tree: WheelTree, base: str, version: str, tool_version: str) -> None:
    """Set METADATA's version, require the runtime layer, rename the dist-info dir."""
    metadata = tree.dist_info / "METADATA"
    lines = metadata.read_text().split("\n")
    header_end = lines.index("") if "" in lines else len(lines)
    version_rows = [i for i in range(header_end) if lines[i].startswith("Version: ")]
    if len(version_rows) != 1 or lines[version_rows[0]] != f"Version: {base}":
        raise HardenedError(f"METADATA: expected one `Version: {base}` line")
    lines[version_rows[0]] = f"Version: {version}"
    requires = [i for i in range(header_end) if lines[i].startswith("Requires-Dist: ")]
    insert_at = (requires[-1] if requires else version_rows[0]) + 1
    lines.insert(insert_at, f"Requires-Dist: {TOOL_DIST}=={tool_version}")
    metadata.write_text("\n".join(lines))
    tree.rename_dist_info(f"sglang-{version}.dist-info")
