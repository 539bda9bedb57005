"""H8 on the CPU PD harness: pages decode would read that its transfer did not write are
refused by their tags alone, with H3 (page coverage) left out of the build.

H4 is left out too: its patch's context holds H3's import line, so it does not
apply without H3. Upstream's side of the truncation fault (decode reads pages
holding another tenant's KV, behind a 200) is
`test_oversized.test_upstream_truncation_with_unequal_limits_reads_other_tenants_kv`.
"""

from __future__ import annotations

import pytest

from sglang_hardened.runtime.page_tags_seams import FAULT_ENV

from tests.conftest import phase

from .conftest import sandbox_env
from .scenarios import (
    DEPTH,
    FITTING_C,
    LEAK_PARAMS,
    OVERSIZED_B,
    TRUNC_PARAMS,
    observe_probes,
    replies,
    wait_pages_idle,
)

pytestmark = pytest.mark.e2e

WITHOUT = ("H3", "H4")
REFUSED = "sglang-hardened H8"


# 0.5.19's paged allocator needs Triton (no CPU path) for pages over one token. NIXL writes the
# tags two ways: joined to the chunk's handles (0.5.23) or waited for before the KV (0.5.19-0.5.22).
@pytest.mark.parametrize("base,page_size,backend", [("0.5.19", 1, "mooncake"), ("0.5.23", 16, "mooncake"),
                                                    ("0.5.23", 16, "nixl"), ("0.5.19", 1, "nixl")])
def test_h8_refuses_pages_a_truncated_transfer_left_unwritten(start_cluster, base, page_size, backend):
    """Prefill truncates the prompt and sends fewer pages than decode reads: the pages it did
    not send carry no tag of this request's, so decode refuses it; a fitting prompt is served,
    so the tags did travel with the KV."""
    cluster = start_cluster(sandbox_env(base, hardened=True, without=WITHOUT), backend=backend,
                            **(TRUNC_PARAMS | {"page_size": page_size}), **DEPTH)
    idle = cluster.used_tokens()
    with phase(f"scenario truncation {base} {backend} page {page_size} hardened without H3"):
        v = observe_probes(cluster, {"pages_apart": OVERSIZED_B, "control": FITTING_C})
    assert all(r.status == 500 and REFUSED in r.body for r in replies(v["pages_apart"])), v["pages_apart"].replies
    assert not v["pages_apart"].leaked
    assert all(r.status == 200 for r in replies(v["control"])) and not v["control"].leaked
    assert wait_pages_idle(cluster, idle) == idle
    assert "do not carry its tag" in cluster.log_tail("decode", 2000)


@pytest.mark.parametrize("base,fault", [("0.5.23", "drop-last-page"), ("0.5.19", "stale-page-index")])
def test_h8_catches_injected_faults(start_cluster, base, fault):
    """The test hook breaks every request: prefill drops each chunk's last page, or decode points
    a request's first page at one it does not own. Each request is refused before decoding."""
    cluster = start_cluster(sandbox_env(base, hardened=True, without=WITHOUT), **LEAK_PARAMS,
                            extra_env=(*DEPTH["extra_env"], f"{FAULT_ENV}={fault}"))
    idle = cluster.used_tokens()
    with phase(f"scenario fault {fault} {base} hardened without H3"):
        got = [cluster.generate(FITTING_C) for _ in range(3)]
    assert all(r.status == 500 and REFUSED in r.body for r in got), got
    assert wait_pages_idle(cluster, idle) == idle
    assert "TEST FAULT HOOK ON" in cluster.log_tail("prefill", 4000) + cluster.log_tail("decode", 4000)
