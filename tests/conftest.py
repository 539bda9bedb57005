"""Shared fixtures: the checkout's patch tree and one build of every base per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hardened.build import build
from sglang_hardened.lock import load_lock
from sglang_hardened.paths import patches_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def patches() -> Path:
    return patches_dir()


@pytest.fixture(scope="session")
def bases(patches: Path) -> list[str]:
    return list(load_lock(patches))


@pytest.fixture(scope="session")
def built(tmp_path_factory, bases):
    """Every base built once (real upstream wheels from the user's cache)."""
    out = tmp_path_factory.mktemp("dist")
    results, tool = build(bases, out)
    return {r.base: r for r in results}, tool


@pytest.fixture
def make_venv():
    """Build a fresh venv with the tool's runtime deps and wheels installed --no-index --no-deps."""
    return _make_venv


def _make_venv(path: Path, *wheels: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["click", "pyyaml", "packaging"], check=True)
    subprocess.run(pip + ["--no-index", "--no-deps", *map(str, wheels)], check=True)
    return python


@pytest.fixture
def tree_copy(tmp_path, patches, monkeypatch) -> Path:
    """A writable copy of the patch tree, made the one the tool reads."""
    copy = tmp_path / "patches"
    shutil.copytree(patches, copy)
    monkeypatch.setenv("SGLANG_HARDENED_PATCHES", str(copy))
    return copy


@pytest.fixture
def drop_base(tree_copy):
    """Remove a base from the tree copy (series and lock entry), as if upstream just released it."""

    def drop(base: str) -> None:
        shutil.rmtree(tree_copy / base)
        lock = tree_copy / "upstream.lock"
        text = lock.read_text()
        start = text.index(f'[base."{base}"]')
        end = text.find("[base.", start + 1)
        lock.write_text(text[:start] + (text[end:] if end != -1 else ""))

    return drop


@pytest.fixture
def run_cli():
    """Run `sglang-hardened ARGS` as a user would: a real process, exit code and output."""

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sglang_hardened", *args],
            capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=REPO,
        )

    return run
