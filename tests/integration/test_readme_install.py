"""The README's install lines, run as written in a fresh virtualenv, then `sglang-hardened info`:
a user following them gets a working tool (they once installed it --no-deps, without click)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from tests.harness import REPO

README = REPO / "README.md"


def install_lines() -> list[str]:
    """The commands of the README's install block (comments dropped)."""
    block = re.search(r"## Install the result\n\n```sh\n(.*?)```", README.read_text(), re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_install_lines_work_in_a_fresh_venv(built, patches, tmp_path):
    results, tool = built
    newest = list(load_lock(patches))[-1]
    version = hardened_version(newest, load_series(patches, newest).revision)
    lines = install_lines()
    assert f'"sglang=={version}"' in " ".join(lines), "the README installs another version than the series builds"
    dist = tmp_path / "dist"
    dist.mkdir()
    for wheel in (results[newest].wheel, tool):
        shutil.copy(wheel, dist)
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    bin_dir = tmp_path / "venv" / "bin"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(Path.home()), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert f"sglang {version} (upstream" in done.stdout, done.stdout
