"""Fixtures that build sandbox environments and start clusters, one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_hardened.sandbox import cluster as sbc
from sglang_hardened.sandbox.env import SandboxEnv, build_env, wheels_for
from sglang_hardened.sandbox.model import ensure_model
from tests.conftest import phase

OVERLAY = Path(__file__).parents[1] / "cpu_overlay"
PORTS_USED: list[int] = []  # every port a cluster of this session held
_ENVS: dict[tuple[str, bool], SandboxEnv] = {}


def sandbox_env(base: str, hardened: bool = False) -> SandboxEnv:
    """The environment for ``base``, upstream or hardened (built once per session)."""
    key = (base, hardened)
    if key not in _ENVS:
        flavour = "hardened" if hardened else "upstream"
        with phase(f"wheels {base} {flavour}"):
            wheels = wheels_for(base, hardened)
        with phase(f"env {base} {flavour}"):
            env = build_env(base, wheels, OVERLAY)
        with phase(f"model {base}"):
            ensure_model(env)
        _ENVS[key] = env
    return _ENVS[key]


def launch(env: SandboxEnv, **params) -> sbc.Cluster:
    """Start a cluster, timed as a phase, its ports kept for the leftovers check; the caller stops it."""
    p = sbc.ClusterParams(base=env.base, **params)
    with phase(f"cluster start {p.base} {p.backend}"):
        c = sbc.start(env, p, ensure_model(env))
    PORTS_USED.extend(proc.port for proc in c.procs.values())
    PORTS_USED.append(c.bootstrap_port)
    return c


@pytest.fixture
def start_cluster(request) -> Iterator[Callable[..., sbc.Cluster]]:
    """Start a cluster with given params; stopped (all pids killed) when the test ends."""
    started: list[sbc.Cluster] = []
    request.node.sandbox_clusters = started

    def _start(env: SandboxEnv, **params) -> sbc.Cluster:
        started.append(launch(env, **params))
        return started[-1]

    yield _start
    for c in started:
        c.stop()


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
