"""The README's install lines, run as written in a fresh virtualenv, then `sglang-hardened info`:
a user following them gets a working tool (they once installed it --no-deps, without click), on
the Python the sandbox runs and on the official image's (3.12), where pip must find a wheel
built for it among every wheel the build writes (it once found none: only cp311 was built)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_hardened.common.pythons import interpreter, this_version
from sglang_hardened.pipeline.build import build
from sglang_hardened.pipeline.lock import load_lock
from tests.harness import REPO

README = REPO / "README.md"
THIS = this_version()


def install_lines() -> list[str]:
    """The commands of the README's install block (comments dropped)."""
    block = re.search(r"## Install the result\n\n```sh\n(.*?)```", README.read_text(), re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


@pytest.fixture(scope="module")
def dist(patches, tmp_path_factory) -> tuple[Path, list]:
    """The newest base's wheels for this machine and both Pythons tested, side by side as
    `scripts/build-wheel` writes them (tests/integration/test_build.py builds every one): pip must
    pick the venv's."""
    newest = list(load_lock(patches))[-1]
    out = tmp_path_factory.mktemp("dist")
    tags = {f"cp{v.replace('.', '')}" for v in (THIS, "3.12")}
    results, _ = build([newest], out, choose=lambda wheels: [w for w in wheels if w.arch == platform.machine()
                                                             and w.python in tags])
    return out, results


@pytest.mark.parametrize("version", [THIS, "3.12"])
def test_the_readme_install_lines_work_in_a_fresh_venv(version, dist, tmp_path):
    out, results = dist
    newest, hardened = results[0].base, results[0].version
    lines = install_lines()
    assert f'"sglang=={hardened}"' in " ".join(lines), "the README installs another version than the series builds"
    tag = f"cp{version.replace('.', '')}"
    assert any(f"-{tag}-{tag}-" in r.wheel.name for r in results), f"no {tag} wheel was built"
    shutil.copytree(out, tmp_path / "dist")
    subprocess.run([interpreter(version), "-m", "venv", str(tmp_path / "venv")], check=True)
    bin_dir = tmp_path / "venv" / "bin"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(Path.home()), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for line in lines:
        done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert f"sglang {hardened} (upstream sglang-{newest}-{tag}-{tag}-" in done.stdout, done.stdout
    assert f"on {tag} {platform.machine()}" in done.stdout, done.stdout
