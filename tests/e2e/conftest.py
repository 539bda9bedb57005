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


@pytest.fixture
def start_cluster(request) -> Iterator[Callable[..., sbc.Cluster]]:
    """Start a cluster with given params (and model variant); stopped (all pids killed) when the test ends."""
    started: list[sbc.Cluster] = []
    request.node.sandbox_clusters = started

    def _start(env: SandboxEnv, model: str = "tiny", **params) -> sbc.Cluster:
        p = sbc.ClusterParams(base=env.base, **params)
        with phase(f"cluster start {p.base} {p.backend}"):
            c = sbc.start(env, p, ensure_model(env, model))
        started.append(c)
        PORTS_USED.extend(proc.port for proc in c.procs.values())
        PORTS_USED.append(c.bootstrap_port)
        return c

    yield _start
    for c in started:
        c.stop()
