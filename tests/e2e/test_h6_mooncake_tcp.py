"""H6 on real Mooncake (TCP, 127.0.0.1): one call over the per-call limit fails, and so do calls
to one peer at once over it together; the bounded split arrives. And one call lasts as long
as its bytes take: without the byte bound it outlives the release timeout.

No SGLang here: the engine's own behaviour, with default settings, is what
the bound is sized against (tests/e2e/test_h6_batches.py shows it in a
real PD cluster).
"""

from __future__ import annotations

import pytest

from sglang_hardened.common.knobs import TRANSFER_LINK_RATE
from sglang_hardened.runtime.release_timeout import RELEASE_TIMEOUT_ENV
from sglang_hardened.runtime.transfer_bounds import bounds_from
from sglang_hardened.sandbox.mooncake_pair import Case, run

from .conftest import sandbox_env

pytestmark = pytest.mark.e2e

OVER_THE_LIMIT = 4096  # entries: twice what one Mooncake TCP call accepts with default settings
PART = 1000  # entries: one call of it is accepted; four at once to one peer are not
MIB = 1 << 20
CHUNK_MIB = 512  # a chunk's KV, in 1 MiB entries: far under the entry limit, so only bytes count


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


def test_without_the_byte_bound_one_call_outlives_the_release_timeout():
    """Review: the byte bound, shown necessary. A synchronous call cannot be interrupted and
    lasts as long as its bytes take on the link, so a chunk's KV sent as one call outlives any
    release timeout once it is large enough, and decode may give its pages away under it. To
    keep the test to about 2 GiB, the chunk here is 512 MiB and the release timeout half of what
    this host's loopback takes to move it at its fastest (the best of three calls, measured
    first, in the same run); the link rate the bound is sized for is half that, as an operator
    sizes it below the link. Unbounded, the call lasts past the timeout; through the policy's
    bounds, each call (an eighth of the chunk) ends within it."""
    probes, _ = run(sandbox_env("0.5.23"), [Case(256, MIB)] * 3)
    rate = 256 * MIB / min(p.call_seconds[0] for p in probes)  # bytes/s this link moved at best
    timeout_s = CHUNK_MIB * MIB / rate / 2
    bounds = bounds_from({RELEASE_TIMEOUT_ENV: str(timeout_s), TRANSFER_LINK_RATE.name: str(rate / 2)})
    (unbounded, bounded), _ = run(sandbox_env("0.5.23"), [
        Case(CHUNK_MIB, MIB), Case(CHUNK_MIB, MIB, (bounds.max_entries, bounds.max_bytes))])
    print(f"\nloopback {rate / 1e9:.2f} GB/s, release timeout {timeout_s:.3f} s; {CHUNK_MIB} MiB as one call: "
          f"{unbounded.call_seconds[0]:.3f} s; in {len(bounded.call_seconds)} calls of at most "
          f"{bounds.max_bytes / MIB:.0f} MiB: the longest {max(bounded.call_seconds):.3f} s")
    assert unbounded.arrived and bounded.arrived
    assert unbounded.call_seconds[0] > timeout_s, "one call of the whole chunk ended within the timeout"
    assert max(bounded.call_seconds) < timeout_s
