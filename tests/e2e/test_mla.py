"""MLA: the tiny DeepSeek V3 (sandbox model ``deepseek``) on upstream and hardened 0.5.23
over Mooncake (the truncation over NIXL too in the full matrix), 64-token pages on both roles.

Upstream runs it on CPU as it is, no stand-in: its torch-native attention backend computes the MLA
layers from upstream's MLA KV pool (one latent of kv_lora_rank + qk_rope_head_dim floats per
token, one "KV head"), and the transfer engines move that pool's pages. The scenarios are
test_oversized.py's.
Across ranks (``LAYOUTS``), on Mooncake: TP 2 on both roles (MLA's one latent head is not split,
each rank holds the whole latent of its layers), DP attention (TP 2 as two DP groups, how DeepSeek
decode is deployed; each request on one group's pool; the full matrix only), and prefill in two pipeline stages (decode
one), the layout of upstream's PP-prefill reports (docs/upstream-triage.md): each stage sends its
layers' pages, and every stage writes the request's metadata row.
Full tier only (no claim: the gate shows each claim on the tiny Llama); each test's cost is in its
docstring, measured 2026-12-06 on this 2-core host (the high ends at load 12-17).
"""

from __future__ import annotations

import pytest

from .conftest import sandbox_env
from .scenarios import DEPTH, FITTING_C, FULL_MATRIX, RECIPE_PAGE, TIMEOUT_PARAMS, TRUNC_PARAMS
from .test_oversized import (client_waits_for_decode, error_reaches_client_at_once, hardened_truncation,
                             upstream_truncation)

pytestmark = [pytest.mark.e2e, pytest.mark.full]

BASE, BACKEND, MODEL = "0.5.23", "mooncake", "deepseek"
# upstream logs an MLA pool's size as one "KV size" (an MHA pool's as "K size" and "V size")
MLA_POOL = "KV Cache is allocated. dtype: torch.float32, #tokens: 4096, KV size"
# NIXL moving the MLA pool, in the full matrix (the full run's cluster starts, tests/budget.toml)
BACKENDS = ["mooncake", "nixl"] if FULL_MATRIX else ["mooncake"]


@pytest.mark.parametrize("hardened", [False, True], ids=["upstream", "hardened"])
def test_mla_over_pool_prompt(start_cluster, hardened):
    """The incident's prompt (600 tokens over a 256-token prefill pool) on MLA: upstream's client
    waits out decode's 15 s timeout; hardened (H7 overridden) answers prefill's 400 at once, its
    decode keeping one H8 tag slot per page (MLA's one KV head). A fitting prompt is served by
    both. Cost: one cluster start each; upstream 66 s, hardened 53-67 s."""
    cluster = start_cluster(sandbox_env(BASE, hardened=hardened), MODEL, backend=BACKEND, **TIMEOUT_PARAMS,
                            page_size=RECIPE_PAGE, **(DEPTH if hardened else {}))
    assert MLA_POOL in cluster.log_tail("decode", 10**4)
    assert cluster.generate(FITTING_C).status == 200
    if hardened:
        error_reaches_client_at_once(cluster)
        assert "pages x 1 KV heads" in cluster.log_tail("decode", 10**4)
    else:
        client_waits_for_decode(cluster)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_upstream_truncation_reads_other_tenants_kv(start_cluster, tmp_path, backend):
    """Unequal limits on MLA: decode reads latent KV no transfer wrote for the request behind a
    200 (the answers move with the tenant before; in one page, the ledger's slots). Cost: one
    cluster start; Mooncake 34-94 s, NIXL 46-107 s."""
    upstream_truncation(start_cluster, BASE, backend, tmp_path, RECIPE_PAGE, model=MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_hardened_truncation_is_refused(start_cluster, tmp_path, backend):
    """H3 on MLA: the same prompts refused with a 500 naming H3, a fitting one served, no page
    held after. Cost: one cluster start; Mooncake 29-38 s, NIXL 63-64 s."""
    hardened_truncation(start_cluster, BASE, backend, tmp_path, RECIPE_PAGE, model=MODEL)


# Rank layouts on MLA: each one cluster start per build (Mooncake), the truncation's probes on it.
# With DP attention the tiny DeepSeek's greedy output for one prompt changes between its first,
# uncached prefill and its prefix-cached repeats, no other request between (upstream, 2026-12-06:
# the control's first token 344, then 435): the oracle would read that as a leak, so prefill's
# radix cache is off there. DP attention costs the most (its scenario 150-220 s against 30-45 s),
# so it runs in the full matrix only.
LAYOUTS = {"tp2": dict(tp=2), "prefill-pp2": dict(prefill_pp=2),
           **({"dp2": dict(tp=2, dp=2, extra_flags=(*TRUNC_PARAMS["extra_flags"], "--disable-radix-cache"))}
              if FULL_MATRIX else {})}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_ranks_upstream_truncation_reads_other_tenants_kv(start_cluster, tmp_path, layout):
    """Upstream's truncation on MLA across ranks: decode reads latent KV no transfer wrote for
    the request behind a 200 (pages apart by the oracle, in one page by the ledger's slots).
    Cost: one cluster start each, 2026-12-06 at load 20-45: TP 2 162 s (start 134 s), prefill PP 2
    185 s (141 s), DP 2 with the radix cache off 287 s (119 s)."""
    upstream_truncation(start_cluster, BASE, BACKEND, tmp_path, RECIPE_PAGE, model=MODEL, layout=LAYOUTS[layout])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_ranks_hardened_truncation_is_refused(start_cluster, tmp_path, layout):
    """H3 on MLA across ranks: the same prompts refused with a 500 naming H3 on every rank, a
    fitting one served, no page held after. Across decode ranks the client may read upstream's
    "unknown reason from another rank" instead of H3's: decode's log names H3. Cost: one cluster
    start each, 2026-12-06 at load 20-45: TP 2 140 s (start 101 s), prefill PP 2 163 s (135 s),
    DP 2 with the radix cache off 223 s (80 s)."""
    hardened_truncation(start_cluster, BASE, BACKEND, tmp_path, RECIPE_PAGE, model=MODEL, layout=LAYOUTS[layout])
