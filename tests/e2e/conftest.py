"""Fixtures that build sandbox environments and start clusters, one at a time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import TEST_SESSION
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.common.table import format_table
from sglang_hardened.image.build import wheel_manifest
from sglang_hardened.operations.oracle import Reply
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.sandbox import cluster as sbc
from sglang_hardened.sandbox.env import DEFAULT_PYTHON, SandboxEnv, bases, build_env, wheels_for, with_load_generator
from sglang_hardened.sandbox.model import ensure_model
from tests.harness import CLUSTER_START, SERVER_RESTART, SESSION, phase

from .scenarios import FULL_MATRIX

OVERLAY = Path(__file__).parents[1] / "cpu_overlay"
PORTS_USED: list[int] = []  # every port a cluster of this session held
# every child of this session inherits it: the leftovers check judges this run's processes only
os.environ[TEST_SESSION.name] = f"{os.getpid()}-{time.time_ns()}"
SESSION_MARK = f"{TEST_SESSION.name}={TEST_SESSION.raw()}"
# (scenario, base, backend, build, status, seconds): upstream and hardened in the same run
TIMINGS: list[tuple[str, str, str, str, int, float]] = []
# (base, server, its scheduler's event loops): what every start's servers logged (Cluster.event_loops)
EVENT_LOOPS: set[tuple[str, str, str]] = set()
EnvKey = tuple[str, bool, tuple[str, ...], Path | None, str]
_ENVS: dict[EnvKey, Future[SandboxEnv]] = {}
_ENVS_LOCK = threading.Lock()
# The environments the e2e tests ask for, in about the order they first do: built beside the
# unit and integration tests, which run first (tests/harness.py), so a cold cache's ten minutes of
# downloads and installs overlap them. (base, hardened, the hardening ids left out.) One not listed
# is built when a test asks for it, and the run's summary names it; one listed and never asked for
# costs only background time, so the gate (`--tier gate`) warms only its own. (base, hardened, the
# hardening ids left out, Python: test_probes_safe.py's cluster runs 3.12, as production does.)
Warm = tuple[str, bool, tuple[str, ...], str]
PY = DEFAULT_PYTHON
PREWARM_GATE: list[Warm] = [
    ("0.5.23", False, (), PY), ("0.5.23", True, (), PY), ("0.5.19", False, (), PY), ("0.5.19", True, (), PY),
    ("0.5.19", True, ("H2", "H4"), PY), ("0.5.19", True, ("H1", "H3"), PY), ("0.5.23", True, ("H3", "H4"), PY),
    ("0.5.23", True, (), "3.12"),
]
PREWARM: list[Warm] = PREWARM_GATE + [
    ("0.5.22", False, (), PY), ("0.5.22", True, (), PY), ("0.5.19", True, ("H1",), PY), ("0.5.20", True, (), PY),
    ("0.5.19", True, ("H3", "H4"), PY),
] if not FULL_MATRIX else [*((base, hardened, (), PY) for base in bases() for hardened in (False, True)),
                           ("0.5.23", True, (), "3.12")]
ON_DEMAND: list[str] = []  # environments a test waited for that the prewarm list does not name
# The patch tree every hardened environment is built from, read once before any test runs: the
# prewarm thread builds while unit tests run in the same process, and one of those points the
# tool at an edited copy (`tree_copy`); a build that read it then was 0.5.22 without six patches.
SESSION_PATCHES = patches_dir()
_STOP_PREWARM = threading.Event()


def _flavour(hardened: bool, without: tuple[str, ...], python: str) -> str:
    build = "hardened" + "".join(f" -{h}" for h in without) if hardened else "upstream"
    return build if python == DEFAULT_PYTHON else f"{build} python{python}"


def sandbox_env(base: str, hardened: bool = False, without: tuple[str, ...] = (),
                patches: Path | None = None, python: str = DEFAULT_PYTHON) -> SandboxEnv:
    """The environment for ``base``, upstream or hardened, under ``python`` (built once per
    session); ``without`` leaves those hardening ids' patches out of the hardened build,
    ``patches`` builds from another patch tree (a rebased one). One the prewarm thread is
    building is waited for (a phase of its own: the building is timed where it happens)."""
    key = (base, hardened, without, patches, python)
    with _ENVS_LOCK:
        future, owner = _ENVS.get(key), key not in _ENVS
        if owner:
            future = _ENVS[key] = Future()
    if owner:
        try:
            future.set_result(_build(*key))
        except BaseException as e:
            future.set_exception(e)
            if threading.current_thread() is not threading.main_thread():
                with _ENVS_LOCK:  # the test that asks builds it again, and fails with its own error
                    _ENVS.pop(key, None)
        if threading.current_thread() is threading.main_thread() and (base, hardened, without, python) not in _WARMING:
            ON_DEMAND.append(f"{base} {_flavour(hardened, without, python)}"
                             + (" (another patch tree)" if patches else ""))
    elif not future.done():
        with phase(f"prewarm wait {base} {_flavour(hardened, without, python)}"):
            future.exception()
        if future.exception() is not None and _ENVS.get(key) is not future:
            return sandbox_env(*key)  # the prewarm's build failed: once more here
    return future.result()


def _build(base: str, hardened: bool, without: tuple[str, ...], patches: Path | None, python: str) -> SandboxEnv:
    flavour = _flavour(hardened, without, python)
    with phase(f"wheels {base} {flavour}"):
        wheels = wheels_for(base, hardened, without, patches or SESSION_PATCHES, python)
        if hardened:
            _check_built_from(wheels[0], patches or SESSION_PATCHES, base, without)
    with phase(f"env {base} {flavour}"):
        env = build_env(base, wheels, OVERLAY, python)
    with phase(f"model {base}"):
        ensure_model(env)
    return env


def _check_built_from(wheel: Path, tree: Path, base: str, without: tuple[str, ...]) -> None:
    """The wheel carries exactly the patches its tree's series names, less ``without``'s: an
    environment built from another tree fails here, not later as a hardening claim that fails."""
    expected = [p.name for p in load_series(tree, base).patches if p.hardening_id not in without]
    got = [p["name"] for p in wheel_manifest(wheel)["patches"]]
    if got != expected:
        raise AssertionError(f"{wheel.name} was built from another patch tree than {tree}: it carries "
                             f"{len(got)} patches, the series names {len(expected)} "
                             f"(missing: {sorted(set(expected) - set(got))})")


_WARMING: list[Warm] = []  # the list this run's prewarm thread builds
_PREWARM_THREADS: list[threading.Thread] = []


def _prewarm(load_generator: bool) -> None:
    for base, hardened, without, python in _WARMING:
        if _STOP_PREWARM.is_set():
            return
        try:
            sandbox_env(base, hardened, without, python=python)
        except BaseException:  # noqa: BLE001 - the test that asks for it gets the error
            pass
    if not load_generator:
        return
    try:  # the load generator's layer (test_benchmarks.py), shared by every base's environment
        with phase("env load generator layer"):
            with_load_generator(sandbox_env(_WARMING[0][0]))
    except BaseException:  # noqa: BLE001 - as above
        pass


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the e2e tests' environments when the tests of the other tiers run before
    them: the gate's own list in the gate, every CI environment otherwise."""
    kinds = [item.get_closest_marker("e2e") is not None for item in session.items]
    if any(kinds) and not kinds[0] and not session.config.option.collectonly:
        gate = session.config.getoption("tier") == "gate" and not FULL_MATRIX
        _WARMING.extend(PREWARM_GATE if gate else PREWARM)
        benchmarks = any(i.nodeid.startswith("tests/e2e/test_benchmarks.py") for i in session.items)
        _PREWARM_THREADS.append(threading.Thread(target=_prewarm, args=(benchmarks,), daemon=True,
                                                 name="prewarm sandbox environments"))
        _PREWARM_THREADS[0].start()


def launch(env: SandboxEnv, model: str = "tiny", prefill_env: SandboxEnv | None = None, **params) -> sbc.Cluster:
    """Start a cluster (of a model variant; prefill from another build if given), timed as a
    phase, its ports kept for the leftovers check; the caller stops it."""
    p = sbc.ClusterParams(base=env.base, **params)
    with phase(f"{CLUSTER_START} {p.base} {p.backend}"):
        c = sbc.start(env, p, ensure_model(env, model), prefill_env=prefill_env)
    EVENT_LOOPS.update((p.base, server, ", ".join(sorted(loops))) for server, loops in c.event_loops().items())
    PORTS_USED.extend(proc.port for proc in c.procs.values())
    PORTS_USED.extend(c.bootstrap_ports.values())
    return c


def restart(cluster: sbc.Cluster, role: str, env: SandboxEnv) -> None:
    """Restart one server of a cluster in place, timed as a phase (the budget counts them)."""
    with phase(f"{SERVER_RESTART} {role} {cluster.params.base} {cluster.params.backend}"):
        cluster.restart(role, env)


@pytest.fixture
def start_cluster(request) -> Iterator[Callable[..., sbc.Cluster]]:
    """Start a cluster with given params (and model variant); stopped (all pids killed) when the test ends."""
    started: list[sbc.Cluster] = []
    request.node.sandbox_clusters = started

    def _start(env: SandboxEnv, model: str = "tiny", prefill_env: SandboxEnv | None = None, **params) -> sbc.Cluster:
        started.append(launch(env, model, prefill_env, **params))
        return started[-1]

    yield _start
    for c in started:
        c.stop()


def record_timing(scenario: str, base: str, backend: str, build: str, reply: Reply) -> None:
    """Note how long a client waited for an answer, for the table at the end of the run."""
    TIMINGS.append((scenario, base, backend, build, reply.status, reply.seconds))


def pytest_terminal_summary(terminalreporter) -> None:
    """The client-wait table; and, once every test and cluster has been torn down, the
    leftovers check: a process or port the harness left behind fails the run."""
    if TIMINGS:
        rows = [(s, base, backend, build, str(status), f"{seconds:.2f}")
                for s, base, backend, build, status, seconds in sorted(set(TIMINGS))]
        terminalreporter.write_line("\nclient waits (same run):")
        terminalreporter.write_line(format_table(("scenario", "base", "backend", "build", "status", "seconds"), rows))
    if EVENT_LOOPS:
        terminalreporter.write_line("\nevent loops the servers' schedulers ran (every start):")
        terminalreporter.write_line(format_table(("base", "server", "event loop"), sorted(EVENT_LOOPS)))
    if ON_DEMAND:
        terminalreporter.write_line(f"\nenvironments built when a test asked (not in conftest's prewarm list): "
                                    f"{', '.join(ON_DEMAND)}")
    if PORTS_USED and (left := sbc.leftovers(PORTS_USED, within=SESSION_MARK)):
        terminalreporter.write_line(f"LEFT BEHIND by the harness: {', '.join(left)}", red=True, bold=True)
        SESSION[0].exitstatus = pytest.ExitCode.TESTS_FAILED


# Clusters shared across modules: at most this many are kept (idle ones sleep, but each holds
# about 1.5 GiB); the least recently used is stopped first, and started again if asked for again.
SHARED_KEPT = 3
_SHARED: dict[tuple[bool, str, sbc.ClusterParams], sbc.Cluster] = {}


def shared(base: str, hardened: bool = False, python: str = DEFAULT_PYTHON, **params) -> sbc.Cluster:
    """The running cluster of this build, under this Python, with these parameters, started at
    the first ask: for tests that leave it as they found it (no fault injected, no server killed,
    pages back to idle), in any module. A start is about 20 s of CI's budget; sharing one is free."""
    key = (hardened, python, sbc.ClusterParams(base=base, **params))  # defaults spelled out or not, one cluster
    cluster = _SHARED.pop(key, None) or launch(sandbox_env(base, hardened, python=python), **params)
    _SHARED[key] = cluster  # now the most recently used
    while len(_SHARED) > SHARED_KEPT:
        _SHARED.pop(next(iter(_SHARED))).stop()
    return cluster


def pytest_sessionfinish() -> None:
    """Stop the shared clusters, and let an environment build in progress finish (a killed pip
    leaves half an environment to rebuild); the leftovers check runs after this."""
    while _SHARED:
        _SHARED.popitem()[1].stop()
    _STOP_PREWARM.set()
    for thread in _PREWARM_THREADS:
        thread.join()


@pytest.fixture
def share(request) -> Callable[..., sbc.Cluster]:
    """``shared`` for a test: the cluster's log tails go into the test's report if it fails."""

    def _share(base: str, hardened: bool = False, **params) -> sbc.Cluster:
        cluster = shared(base, hardened, **params)
        request.node.sandbox_clusters = [*getattr(request.node, "sandbox_clusters", []), cluster]
        return cluster

    return _share


@pytest.fixture
def shared_cluster(request, share) -> sbc.Cluster:
    """The module's cluster, shared with any other module that asks for the same: the module
    sets CLUSTER = (base, hardened, params); ``python="3.12"`` among the params runs it there."""
    base, hardened, params = request.module.CLUSTER
    return share(base, hardened, **params)
