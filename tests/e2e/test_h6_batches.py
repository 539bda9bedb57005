"""H6 on real servers: a transfer with more entries than one Mooncake TCP call accepts.

The deep sandbox model (1600 layers) makes every chunk's transfer 2 x 1600
entries per run of pages, over Mooncake TCP's ~2,050 per call with default
settings, whatever the prompt: upstream sends it as one call and the request
fails; a hardened build splits it into bounded calls and serves it. Servers
are started as the sandbox does, without `sglang-hardened launch`: the bound
holds from the policy file's defaults alone.
"""

from __future__ import annotations

import pytest

from sglang_hardened.runtime.transfer_bounds import bounds_from

from .conftest import sandbox_env

pytestmark = pytest.mark.e2e

# page_size 1; pools hold the context on both roles (hardened builds refuse less), and decode's
# also holds the prompt plus its 512-token reserve (else decode never admits it).
PARAMS = dict(prefill_pool_tokens=1024, decode_pool_tokens=2048, context_length=1024, page_size=1,
              waiting_timeout_s=60)
PROMPT = "page cache token key of the " * 100  # 600 tokens: fits both pools
REJECTED = "TCP lane queue-full rejection"


# One base shows upstream's failure in CI (0.5.19, with no bound at all, fails the same way).
@pytest.mark.parametrize("base", ["0.5.23"])
def test_upstream_fails_a_transfer_over_the_tcp_per_call_limit(base, start_cluster):
    cluster = start_cluster(sandbox_env(base), model="deep", probe_transfer=False, **PARAMS)
    reply = cluster.generate(PROMPT, timeout=300)
    assert reply.status != 200, reply.body[:500]
    assert REJECTED in cluster.log_tail("prefill", 400)


@pytest.mark.parametrize("base", ["0.5.19", "0.5.23"])
def test_hardened_serves_it_in_bounded_calls(base, start_cluster):
    # Upstream's index split (backported to 0.5.19) set low, so the prompt also spans three index batches.
    cluster = start_cluster(sandbox_env(base, hardened=True), model="deep", **PARAMS,
                            extra_env=("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=256",))  # ready = served
    reply = cluster.generate(PROMPT, timeout=300)
    assert reply.status == 200, reply.body[:500]
    prefill_log = cluster.log_tail("prefill", 400)
    bounds = bounds_from({})
    assert (f"sglang-hardened H6: each Mooncake transfer call carries at most {bounds.max_entries} entries "
            f"and {bounds.max_bytes} bytes") in prefill_log
    assert REJECTED not in prefill_log
