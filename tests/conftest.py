"""Shared fixtures: the checkout's patch tree, one build of every base per session, real peers.

The harness (tiers, claims, phases, budget) is the plugin ``tests/harness.py`` (pyproject's addopts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import PATCHES
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.pipeline.build import build
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import copy_without
from tests.harness import REPO


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
    monkeypatch.setenv(PATCHES.name, str(copy))
    return copy


@pytest.fixture
def drop_ids(tree_copy, tmp_path):
    """Leave hardening ids out of one base's series in the tree copy."""

    def drop(base: str, *ids: str) -> None:
        lean = copy_without(tree_copy, base, ids, tmp_path / f"without-{base}")
        shutil.rmtree(tree_copy / base)
        shutil.copytree(lean / base, tree_copy / base)

    return drop


@pytest.fixture
def drop_patches(tree_copy):
    """Leave named patches out of one base's series in the tree copy (a per-base variant that
    another base's series needs a human for)."""

    def drop(base: str, *names: str) -> None:
        series = tree_copy / base / "series"
        series.write_text("".join(f"{line}\n" for line in series.read_text().splitlines() if line.strip() not in names))
        for name in names:
            (tree_copy / base / name).unlink()

    return drop


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


@pytest.fixture
def http_stand_in() -> Iterator[Callable[[Callable[..., tuple[int, bytes]]], str]]:
    """Real loopback HTTP servers for a peer the code under test calls: each answers every
    GET with ``answer(path)`` and every POST with ``answer(path, body)`` (status, body);
    returns the server's ``host:port``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    servers: list[ThreadingHTTPServer] = []

    def serve(answer: Callable[..., tuple[int, bytes]]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._reply(*answer(self.path))

            def do_POST(self):
                self._reply(*answer(self.path, self.rfile.read(int(self.headers["content-length"]))))

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        return f"127.0.0.1:{servers[-1].server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
