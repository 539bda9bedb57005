"""Give an unpacked upstream wheel its hardened identity: version, dependency, and a notice in
each file the build changed."""

from __future__ import annotations

import re

from ..common.errors import HardenedError
from . import unidiff
from .series import Series
from .wheelfile import WheelTree

TOOL_DIST = "sglang-hardened"
VERSION_FILE = "sglang/_version.py"
VERSION_STAMP = "the version stamp"
_VERSION_LINE = re.compile(r"^(__version__ = version = )'([^']+)'$", re.M)
_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=]")  # PEP 263: it counts on line 1 or 2 only


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


def changes(series: Series) -> dict[str, list[str]]:
    """Each file the build changes, with what changed it: the patches that touch it, in series
    order, then the version stamp (a file a patch deletes carries nothing)."""
    changed: dict[str, list[str]] = {}
    for patch in series.patches:
        for fp in unidiff.parse(patch.diff):
            if fp.new == unidiff.DEV_NULL:
                changed.pop(fp.old, None)
            elif patch.name not in changed.setdefault(fp.new, []):
                changed[fp.new].append(patch.name)
    changed.setdefault(VERSION_FILE, []).append(VERSION_STAMP)
    return changed


def change_notice(by: list[str]) -> str:
    """The line a changed file carries: Apache-2.0 section 4(b) asks that modified files say so."""
    return f"# sglang-hardened changed this file from SGLang's: {', '.join(by)}\n"


def notice_line(lines: list[str]) -> int:
    """Where the notice goes: first, but below a shebang or an encoding line, which must stay
    where they are to count."""
    at = 1 if lines and lines[0].startswith("#!") else 0
    for index in range(at, min(2, len(lines))):
        if _CODING.match(lines[index]):
            at = index + 1
    return at


def stamp_change_notices(tree: WheelTree, changed: dict[str, list[str]]) -> None:
    """Give each changed file its notice (`changes` says which and by what)."""
    for name, by in changed.items():
        if not name.endswith(".py"):
            raise HardenedError(f"{name}: changed by {', '.join(by)}, but only a Python file can carry the notice")
        path = tree.root / name
        lines = path.read_text().splitlines(keepends=True)
        at = notice_line(lines)
        path.write_text("".join([*lines[:at], change_notice(by), *lines[at:]]))
