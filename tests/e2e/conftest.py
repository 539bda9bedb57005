"""Fixtures that build sandbox environments and start clusters, one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_hardened.common.table import format_table
from sglang_hardened.operations.oracle import Reply
from sglang_hardened.sandbox import cluster as sbc
from sglang_hardened.sandbox.env import SandboxEnv, build_env, wheels_for
from sglang_hardened.sandbox.model import ensure_model
from tests.conftest import CLUSTER_START, SERVER_RESTART, SESSION, phase

OVERLAY = Path(__file__).parents[1] / "cpu_overlay"
PORTS_USED: list[int] = []  # every port a cluster of this session held
# (scenario, base, backend, build, status, seconds): upstream and hardened in the same run
TIMINGS: list[tuple[str, str, str, str, int, float]] = []
_ENVS: dict[tuple[str, bool, tuple[str, ...], Path | None], SandboxEnv] = {}


def sandbox_env(base: str, hardened: bool = False, without: tuple[str, ...] = (),
                patches: Path | None = None) -> SandboxEnv:
    """The environment for ``base``, upstream or hardened (built once per session);
    ``without`` leaves those hardening ids' patches out of the hardened build,
    ``patches`` builds from another patch tree (a rebased one)."""
    key = (base, hardened, without, patches)
    if key not in _ENVS:
        flavour = "hardened" + "".join(f" -{h}" for h in without) if hardened else "upstream"
        with phase(f"wheels {base} {flavour}"):
            wheels = wheels_for(base, hardened, without, patches)
        with phase(f"env {base} {flavour}"):
            env = build_env(base, wheels, OVERLAY)
        with phase(f"model {base}"):
            ensure_model(env)
        _ENVS[key] = env
    return _ENVS[key]


def launch(env: SandboxEnv, model: str = "tiny", prefill_env: SandboxEnv | None = None, **params) -> sbc.Cluster:
    """Start a cluster (of a model variant; prefill from another build if given), timed as a
    phase, its ports kept for the leftovers check; the caller stops it."""
    p = sbc.ClusterParams(base=env.base, **params)
    with phase(f"{CLUSTER_START} {p.base} {p.backend}"):
        c = sbc.start(env, p, ensure_model(env, model), prefill_env=prefill_env)
    PORTS_USED.extend(proc.port for proc in c.procs.values())
    PORTS_USED.append(c.bootstrap_port)
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
    if PORTS_USED and (left := sbc.leftovers(PORTS_USED)):
        terminalreporter.write_line(f"LEFT BEHIND by the harness: {', '.join(left)}", red=True, bold=True)
        SESSION[0].exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module")
def module_cluster(request) -> Iterator[sbc.Cluster]:
    """One cluster shared by a module's tests: the module sets CLUSTER = (base, hardened, params)."""
    base, hardened, params = request.module.CLUSTER
    cluster = launch(sandbox_env(base, hardened), **params)
    yield cluster
    cluster.stop()


@pytest.fixture
def shared_cluster(request, module_cluster: sbc.Cluster) -> sbc.Cluster:
    """The module's cluster, its log tails attached to a failing test's report."""
    request.node.sandbox_clusters = [module_cluster]
    return module_cluster
