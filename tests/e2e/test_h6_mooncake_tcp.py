"""H6 on real Mooncake (TCP, 127.0.0.1): one call over the per-call limit fails; the bounded split arrives.

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
