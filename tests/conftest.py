"""Shared fixtures: the checkout's patch tree and one build of every base per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import pytest

from sglang_hardened.common.paths import patches_dir
from sglang_hardened.common.table import format_table
from sglang_hardened.pipeline.build import build
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import copy_without
from tests.budget import STARTED_ENV, Spent, load_budget, overruns

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


# --- per-phase timings, the suite's budget and sandbox log tails (the e2e harness) ---

TIMINGS: list[tuple[str, float]] = []
# Phase kinds (a phase's name starts with its kind): building sandbox environments, which a warm
# cache skips, and the starts the budget counts.
SETUP_KINDS = ("wheels", "env", "model")
CLUSTER_START, SERVER_RESTART = "cluster start", "server restart"
MODULE_SECONDS: dict[str, float] = {}
SESSION: list[pytest.Session] = []  # the running session, whose exit status an overrun fails
SUITE_STARTED = os.environ.pop(STARTED_ENV, None)  # read once: a pytest a test starts is no whole suite


def eventually(pred, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    """Whether ``pred()`` turns true within ``timeout_s`` (polled): for state another thread or
    process changes."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


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


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of the run for the summary printed at the end."""
    start = time.monotonic()
    try:
        yield
    finally:
        TIMINGS.append((name, time.monotonic() - start))


def _kind(name: str) -> str:
    return next((k for k in (CLUSTER_START, SERVER_RESTART, *SETUP_KINDS) if name.startswith(k)), name.split()[0])


def spent(run_seconds: float) -> Spent:
    """This run's use of the budget, from its phases."""
    return Spent(run_seconds=round(run_seconds), setup_seconds=round(sum(s for n, s in TIMINGS if _kind(n) in SETUP_KINDS)),
                 cluster_starts=sum(_kind(n) == CLUSTER_START for n, _ in TIMINGS),
                 server_restarts=sum(_kind(n) == SERVER_RESTART for n, _ in TIMINGS))


def pytest_sessionstart(session: pytest.Session) -> None:
    SESSION.append(session)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real clusters run last, in their own order: the unit tests before them run while
    tests/e2e/conftest.py builds the clusters' environments in the background."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::")[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    write = terminalreporter.write_line
    if TIMINGS:
        terminalreporter.section("per-phase times")
        for name, seconds in TIMINGS:
            write(f"{seconds:8.1f}s  {name}")
        kinds: dict[str, list[float]] = {}
        for name, seconds in TIMINGS:
            kinds.setdefault(_kind(name), []).append(seconds)
        write("\n" + format_table(("phase kind", "count", "seconds"), [
            (k, str(len(v)), f"{sum(v):.0f}") for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))]))
    if MODULE_SECONDS:
        terminalreporter.section("per-module times (setup, call, teardown)")
        write(format_table(("module", "seconds"), [(m, f"{s:.0f}") for m, s in sorted(
            MODULE_SECONDS.items(), key=lambda kv: -kv[1]) if s >= 1.0]))
    if SUITE_STARTED:  # a whole-suite run: hold it to the budget
        used, budget = spent(time.time() - float(SUITE_STARTED)), load_budget()
        terminalreporter.section("budget (tests/budget.toml)")
        write(format_table(("line", "spent", "budget"), [
            (f.name, f"{getattr(used, f.name):g}", f"{getattr(budget, f.name):g}") for f in fields(Spent)]))
        over = overruns(used, budget)
        for line in over:
            terminalreporter.write_line(f"OVER BUDGET {line}", red=True, bold=True)
        if over:
            SESSION[0].exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that started sandbox clusters gets each server's log tail."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for c in getattr(item, "sandbox_clusters", []):
            rep.sections.append((f"sandbox {c.params.base} logs", c.log_tails(60)))
