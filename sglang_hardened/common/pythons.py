"""Finding a CPython of a given version to run beside this one.

Upstream ships one SGLang wheel per CPython, so the sandbox and the install tests run other
Pythons than the tool's own (production's official image runs 3.12). pyenv's shims need pyenv's
own shell environment and fail from a subprocess, so its versions folder is asked before PATH.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
from pathlib import Path

from .errors import HardenedError


def this_version() -> str:
    """This interpreter's ``major.minor``, e.g. ``3.11``."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def runs_on(version: str) -> str:
    """What a process of CPython ``version`` on this machine runs, as a node reports it
    (``runtime.identity.runs_on``) and a pin names it (``UpstreamPin.runs_on``): ``cp312 x86_64``."""
    return f"cp{version.replace('.', '')} {platform.machine()}"


def interpreter(version: str) -> str:
    """A python of ``version`` (``3.12``): this one, pyenv's newest of that version, or one on PATH."""
    if not re.fullmatch(r"3\.\d+", version):
        raise HardenedError(f"a Python version is major.minor, e.g. 3.12, not {version!r}")
    if version == this_version():
        return sys.executable
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    pyenv = sorted(versions.glob(f"{version}.*/bin/python{version}"),
                   key=lambda p: [int(n) for n in re.findall(r"\d+", p.parts[-3])])
    found = str(pyenv[-1]) if pyenv else shutil.which(f"python{version}")
    if not found:
        raise HardenedError(f"python{version} is needed and is neither on PATH nor in {versions}: install it "
                            f"(`pyenv install {version}`, `uv python install {version}`, or your system's "
                            f"python{version} package)")
    return found
