"""The truncation across instances: two prefills of unequal input limits and two decodes, as a gateway
pairs them per request. A prompt that fits the larger prefill, not the smaller, lands on the
smaller one and on decode-1, after another tenant's history through the larger prefill and
decode-1: the pages decode-1 gives it last held KV the other prefill wrote.

The scenario is test_oversized.py's truncation (``upstream_truncation``, ``hardened_truncation``:
``--allow-auto-truncate``, 16-token pages, judged by the page ledger and the differential oracle),
sent to one pair of a 2x2 cluster. The hardened cluster overrides H7 (``DEPTH``), which would
refuse every request for the smaller prefill at decode first (test_replicas.py shows that), so
that H3 is what is proved across instances.

Tier: full (no claim: the gate shows H3 on one pair). Cost: two 2x2 starts (upstream and hardened
0.5.23: 97 s and 106 s) and 35 s of scenarios, 250 s with the environments built (2026-12-06,
`scripts/test tests/e2e/test_replicas_truncation.py`, on the shared 2-core machine at load 20).
"""

from __future__ import annotations

import pytest

from .test_oversized import hardened_truncation, upstream_truncation

pytestmark = pytest.mark.e2e

# prefill-1's 512-token context gives it the single pair's prefill limit (506 tokens, what it keeps of
# a longer prompt) over the same 1024-token pool; prefill's and both decodes' limit is 1018, so prefill
# serves every probe whole. (A smaller pool would not do: with its context at most its pool, as
# `prefill_limits` gives it, upstream never schedules the truncated prompt, whose last 16-token page
# the pool has no room for, and the transfer under test never starts; found 2026-12-06.)
ACROSS = dict(prefills=2, decodes=2, prefill_contexts=(1024, 512), context_length=1024)
PAIR = ("prefill-1", "decode-1")


def test_upstream_0523_truncates_on_the_smaller_prefill_and_decode_reads_pages_never_sent(start_cluster, tmp_path):
    """Upstream 0.5.23 answers 200 over KV no transfer wrote for the request: pages apart, the
    answers change with the other tenant's history through the other prefill; in one page, the
    ledger shows the three positions past prefill-1's 506 tokens read from slots it never held for
    the request. The larger prefill serves the same prompts whole, through both decodes."""
    upstream_truncation(start_cluster, "0.5.23", "mooncake", tmp_path, layout=ACROSS, pair=PAIR)


def test_hardened_0523_refuses_on_the_smaller_prefill_and_the_other_keeps_serving(start_cluster, tmp_path):
    """Hardened 0.5.23 refuses both, naming H3 (prefill-1 sends 32 pages where decode-1 holds the
    prompt's 38; in one page, decode-1's own check), decodes nothing, and leaks no page; the
    larger prefill serves the same prompts whole through both decodes, every page read its own."""
    hardened_truncation(start_cluster, "0.5.23", "mooncake", tmp_path, layout=ACROSS, pair=PAIR)
