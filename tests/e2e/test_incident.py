"""The oversized-prompt incident in PD mode: reproduced on upstream, acceptance on hardened."""

from __future__ import annotations

import pytest

from sglang_hardened.sandbox.env import SandboxError
from tests.harness import phase

from .conftest import sandbox_env
from .scenarios import LEAK_PARAMS, OVERSIZED_B, TIMEOUT_PARAMS, observe_leak, observe_pair

pytestmark = pytest.mark.e2e


@pytest.mark.claim("H1", "upstream", params=["mooncake"])
@pytest.mark.claim("H2", "upstream", params=["mooncake"])
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_upstream_0519_oversized_prompt_gets_200_and_reads_other_tenants_kv(share, start_cluster, backend):
    # Mooncake's is test_probes_unsafe.py's too. NIXL's is nobody else's, and is stopped here:
    # its prefill keeps the placeholder's transfer in flight and polls it for ever, which took a
    # core from every later test while the cluster was kept (CI's cluster starts went from
    # about 16 s to 30-60 s, 2026-12-05).
    cluster = (share("0.5.19", backend=backend, **LEAK_PARAMS) if backend == "mooncake"
               else start_cluster(sandbox_env("0.5.19"), backend=backend, **LEAK_PARAMS))
    with phase(f"scenario leak 0.5.19 upstream {backend}"):
        obs = observe_leak(cluster)
    b = obs.oversized
    print({label: b.outputs(label) for label in b.replies})
    assert all(r.status == 200 for rs in b.replies.values() for r in rs), b.replies
    at_prefill, _ = observe_pair(cluster, OVERSIZED_B)
    assert at_prefill.status == 200, "0.5.19's prefill reports success over the pending 400 (H2)"
    assert not obs.control.leaked, "a fitting prompt must not depend on history (setup is deterministic)"
    for after_a1, after_a2 in zip(b.outputs("A1"), b.outputs("A2")):
        assert after_a1 != after_a2, "B's output should change with tenant A's prompt (the leak)"
    assert b.leaked


@pytest.mark.parametrize("base,params", [("0.5.19", LEAK_PARAMS), ("0.5.23", TIMEOUT_PARAMS)])
def test_hardened_refuses_the_incident_configuration_at_startup(start_cluster, base, params):
    """H7: a prefill pool below the context length is refused, so B's path is unreachable."""
    with pytest.raises(SandboxError, match="exited during start-up(?s:.*)sglang-hardened H7"):
        start_cluster(sandbox_env(base, hardened=True), **params)
