"""What an image holds, read from inside it: ``python3 -m sglang_hardened.image.inventory``
prints its OS, Debian packages and Python distributions as JSON, which sbom.py makes the
image's SBOM of. The standard library only: it runs with the image's own Python, once the
build has installed the tool there.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

OS_RELEASE = Path("/etc/os-release")
DPKG_FORMAT = "${Package}\\t${Version}\\t${Architecture}\\t${db:Status-Abbrev}\\n"


def os_release() -> dict[str, str]:
    """/etc/os-release's fields (ID, VERSION_ID, PRETTY_NAME ...), unquoted."""
    if not OS_RELEASE.is_file():
        return {}
    pairs = (line.split("=", 1) for line in OS_RELEASE.read_text().splitlines() if "=" in line)
    return {key: value.strip().strip('"') for key, value in pairs}


def debian_packages() -> list[dict[str, str]]:
    """Every installed Debian package (CUDA's and the OS's alike, on upstream's Ubuntu base)."""
    if not shutil.which("dpkg-query"):
        return []
    listed = subprocess.run(["dpkg-query", "-W", "-f", DPKG_FORMAT], capture_output=True, text=True, check=True).stdout
    rows = (line.split("\t") for line in listed.splitlines())
    return [{"name": name, "version": version, "arch": arch} for name, version, arch, status in rows
            if status.startswith("ii")]


def python_distributions() -> list[dict[str, str]]:
    """Every distribution this Python imports from, one per name (the first on the path wins, as for import)."""
    found: dict[str, dict[str, str]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in found:
            found[name.lower()] = {"name": name, "version": dist.version}
    return sorted(found.values(), key=lambda d: d["name"].lower())


def main() -> None:
    json.dump({"os": os_release(), "python": sys.version.split()[0], "debian": debian_packages(),
               "pypi": python_distributions()}, sys.stdout)


if __name__ == "__main__":
    main()
