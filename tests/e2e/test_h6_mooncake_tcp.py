"""H6 on real Mooncake (TCP, 127.0.0.1): one call over the per-call limit fails, and so do calls
to one peer at once over it together; the bounded split arrives.

No SGLang here: the engine's own behaviour, with default settings, is what
the bound is sized against (tests/e2e/test_h6_batches.py shows it in a
real PD cluster).
"""

from __future__ import annotations

import pytest

from sglang_hardened.runtime.transfer_bounds import bounds_from
from sglang_hardened.sandbox.mooncake_pair import Case, run

from .conftest import sandbox_env

pytestmark = pytest.mark.e2e

OVER_THE_LIMIT = 4096  # entries: twice what one Mooncake TCP call accepts with default settings
PART = 1000  # entries: one call of it is accepted; four at once to one peer are not


def test_one_call_over_the_tcp_limit_fails_and_the_policy_bounded_split_arrives():
    policy = bounds_from({})
    bounded = (policy.max_entries, policy.max_bytes)
    (unbounded, split, pieces), log = run(sandbox_env("0.5.23"), [
        Case(OVER_THE_LIMIT, 64),
        Case(OVER_THE_LIMIT, 64, bounded),
        Case(4, 1_000_003, (policy.max_entries, 1 << 20)),  # entries cut at the byte bound, odd offsets
    ])
    assert unbounded.rc != 0 and not unbounded.arrived
    assert "TCP lane queue-full rejection" in log
    assert split.rc == 0 and split.arrived
    assert split.call_entries == [policy.max_entries] * (OVER_THE_LIMIT // policy.max_entries)
    assert pieces.rc == 0 and pieces.arrived and len(pieces.call_entries) == 4


def test_calls_at_once_to_one_peer_share_the_limit_and_the_seam_bounds_them_together():
    """Upstream's per-layer path (a custom memory pool, GPU-only, so not in a CPU cluster here)
    writes every layer in its own call at once: each call is under the limit, together they
    are not. Through the seam the parts share one ``InFlight`` and all arrive."""
    policy = bounds_from({})
    alone, together, bounded = run(sandbox_env("0.5.23"), [
        Case(PART, 64),
        Case(4 * PART, 64, threads=4),
        Case(4 * PART, 64, (policy.max_entries, policy.max_bytes), threads=4),
    ])[0]
    assert alone.rc == 0 and alone.arrived
    assert together.rc != 0 and not together.arrived and together.call_entries == [PART] * 4
    assert bounded.rc == 0 and bounded.arrived and bounded.call_entries == [PART] * 4
