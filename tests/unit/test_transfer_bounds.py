"""H6's split on its own: every batch within both bounds, every byte written once, in order.

Real Mooncake over TCP (tests/e2e/test_h6_mooncake_tcp.py) and real servers
(tests/e2e/test_h6_batches.py) show why the bounds are needed.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from sglang_hardened.common.knobs import TRANSFER_LINK_RATE, TRANSFER_MAX_ENTRIES
from sglang_hardened.runtime import transfer_bounds
from sglang_hardened.runtime.policy import load_limits
from sglang_hardened.runtime.release_timeout import RELEASE_TIMEOUT_ENV, release_timeout_s
from sglang_hardened.runtime.transfer_bounds import (Bounds, batch_transfer_sync,
                                                     bounds_from, split)

# Mooncake TCP (0.3.13, default settings) rejects one call of more than about this many entries.
MOONCAKE_TCP_ENTRIES_PER_CALL = 2050


def _entries(count: int, seed: int = 0) -> tuple[list[int], list[int], list[int]]:
    """Entries shaped like a KV transfer: runs of pages of a few sizes at scattered addresses."""
    rng = random.Random(seed)
    lengths = [rng.choice([1, 7, 4096, 65536, 3 * 65536 + 5]) for _ in range(count)]
    srcs = [rng.randrange(1 << 40) for _ in range(count)]
    dsts = [rng.randrange(1 << 40) for _ in range(count)]
    return srcs, dsts, lengths


def _bytes(srcs, dsts, lengths) -> list[tuple[int, int]]:
    """Every (source byte, destination byte) pair the entries write, in order."""
    return [(s + i, d + i) for s, d, n in zip(srcs, dsts, lengths) for i in range(n)]


@pytest.mark.parametrize("bounds", [Bounds(1, 1 << 40), Bounds(3, 10_000), Bounds(1024, 1 << 40),
                                    Bounds(1024, 65536), Bounds(5, 4096)])
def test_batches_respect_both_bounds(bounds):
    batches = list(split(*_entries(3000), bounds))
    for srcs, dsts, lengths in batches:
        assert 1 <= len(srcs) == len(dsts) == len(lengths) <= bounds.max_entries
        assert sum(lengths) <= bounds.max_bytes and min(lengths) >= 1


@pytest.mark.parametrize("bounds", [Bounds(2, 8), Bounds(3, 5), Bounds(1, 1), Bounds(4, 1000)])
def test_batches_write_every_byte_once_in_order(bounds):
    entries = _entries(40, seed=1)
    entries = (entries[0], entries[1], [n % 23 for n in entries[2]])  # small enough to list every byte
    written = [pair for batch in split(*entries, bounds) for pair in _bytes(*batch)]
    assert written == _bytes(*entries)


def test_under_the_bounds_it_is_one_unchanged_call():
    entries = _entries(1024)
    assert list(split(*entries, Bounds(1024, sum(entries[2])))) == [entries]


def test_an_entry_longer_than_the_byte_bound_is_cut_into_pieces():
    assert list(split([0], [100], [10], Bounds(4, 4))) == [([0], [100], [4]), ([4], [104], [4]), ([8], [108], [2])]


def test_byte_bound_fills_each_call_then_moves_on():
    batches = list(split([0, 50], [1000, 2000], [6, 6], Bounds(8, 8)))
    assert batches == [([0, 50], [1000, 2000], [6, 2]), ([52], [2002], [4])]


def test_policy_defaults_stay_under_mooncake_tcp_and_the_release_timeout():
    limits = load_limits("H6")
    bounds = bounds_from({})
    # policy.yaml: 1024 entries; bytes = 30 s release timeout x 0.5 fraction x 125,000,000 B/s = 1,875,000,000
    assert bounds == Bounds(1024, 1_875_000_000)
    assert bounds.max_entries <= MOONCAKE_TCP_ENTRIES_PER_CALL // 2
    seconds_per_call = bounds.max_bytes / limits["link_rate_bytes_per_s"]
    timeout_s = release_timeout_s({})  # upstream's default
    assert seconds_per_call <= timeout_s * limits["timeout_fraction"] < timeout_s


def test_env_overrides_each_number_and_the_byte_bound_follows_the_timeout():
    bounds = bounds_from({TRANSFER_MAX_ENTRIES.name: "64", TRANSFER_LINK_RATE.name: "1000", RELEASE_TIMEOUT_ENV: "4"})
    assert bounds == Bounds(64, 2000)  # 4 s timeout x the policy's 0.5 fraction x 1000 B/s


def test_nonsense_bounds_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        bounds_from({TRANSFER_MAX_ENTRIES.name: "0"})


def test_seam_sends_each_batch_and_stops_at_the_first_failure(monkeypatch):
    monkeypatch.setattr(transfer_bounds, "process_bounds", lambda: Bounds(2, 1 << 40))
    calls = []

    def write(session, srcs, dsts, lengths):
        calls.append((session, srcs))
        return -1 if len(calls) == 2 else 0

    assert batch_transfer_sync(write, "peer", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1] * 5) == -1
    assert calls == [("peer", [1, 2]), ("peer", [3, 4])]
    calls.clear()
    assert batch_transfer_sync(lambda *a: calls.append(a) or 0, "peer", [], [], []) == 0 and calls == []


def _layers_at_once(monkeypatch, bounds: Bounds, peers: list[str], lengths: list[int]) -> dict[str, int]:
    """Each peer's layer sent on its own thread, as the per-layer path does; the peaks of
    bytes in flight, entries in flight to one peer, and peers written to at once."""
    monkeypatch.setattr(transfer_bounds, "process_bounds", lambda: bounds)
    monkeypatch.setattr(transfer_bounds, "_in_flight", transfer_bounds.InFlight())
    lock = threading.Lock()
    now_bytes, now_entries, written = 0, Counter(), Counter()
    peaks = {"bytes": 0, "entries": 0, "peers": 0}

    def write(peer, srcs, dsts, batch_lengths):
        nonlocal now_bytes
        with lock:
            now_bytes += sum(batch_lengths)
            now_entries[peer] += len(srcs)
            peaks.update(bytes=max(peaks["bytes"], now_bytes), entries=max(peaks["entries"], now_entries[peer]),
                         peers=max(peaks["peers"], sum(1 for n in now_entries.values() if n)))
        time.sleep(0.002)
        with lock:
            now_bytes -= sum(batch_lengths)
            now_entries[peer] -= len(srcs)
            written[peer] += sum(batch_lengths)
        return 0

    threads = [threading.Thread(target=batch_transfer_sync, args=(write, peer, list(range(len(lengths))),
                                                                  list(range(len(lengths))), lengths))
               for peer in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert written == Counter({peer: peers.count(peer) * sum(lengths) for peer in peers}), "every byte written once"
    return peaks


def test_concurrent_calls_share_the_byte_bound(monkeypatch):
    """Eight layers to eight peers at once (calls of one entry, 1-3 bytes, so several overlap)
    carry no more bytes together than one call may."""
    peaks = _layers_at_once(monkeypatch, Bounds(1, 10), [f"peer{i}" for i in range(8)], [1, 2, 3] * 4)
    assert 3 < peaks["bytes"] <= 10, peaks


def test_concurrent_calls_to_one_peer_share_the_entry_bound(monkeypatch):
    """Mooncake TCP queues a peer's entries: layers to one peer stay under one call's entries
    together, while calls to another peer still overlap them."""
    peaks = _layers_at_once(monkeypatch, Bounds(4, 1 << 20), ["peer0", "peer1"] * 4, [1] * 12)
    assert peaks["entries"] == 4 and peaks["peers"] == 2, peaks


class KVPoll:
    """Upstream's KVPoll (sglang/srt/disaggregation/base/conn.py, the same on every base): a
    stand-in, since the test environment has no SGLang."""

    Failed, Bootstrapping, WaitingForInput, Transferring, Success = range(5)


def _chunk_calls(monkeypatch, fail_after: int | None, timeout_s: float = 30.0) -> tuple[int, int]:
    """Send one chunk as 10 bounded calls on this thread, the way the transfer worker's seams
    do; the room fails after ``fail_after`` calls. Returns (what the send returned, calls made)."""
    import sys
    import types

    upstream = types.ModuleType("sglang.srt.disaggregation.base.conn")
    upstream.KVPoll = KVPoll
    monkeypatch.setitem(sys.modules, upstream.__name__, upstream)
    monkeypatch.setattr(transfer_bounds, "process_release_timeout_s", lambda: timeout_s)
    statuses, failures, calls = {7: KVPoll.Transferring}, {}, []
    manager = types.SimpleNamespace(request_status=statuses, record_failure=failures.__setitem__,
                                    update_status=statuses.__setitem__)  # upstream's, as the seam uses them

    def write(_peer, *_batch) -> int:
        calls.append(1)
        if fail_after is not None and len(calls) == fail_after:
            statuses[7] = KVPoll.Failed  # decode's abort, seen by prefill's ZMQ thread
        return 0

    transfer_bounds.begin_send(manager, 7)
    try:
        ret = batch_transfer_sync(write, "peer", list(range(10)), list(range(10)), [1] * 10,
                                  bounds=Bounds(max_entries=1, max_bytes=1))
    finally:
        stopped = transfer_bounds.send_stopped(ret)
    assert stopped == (ret == transfer_bounds.STOPPED)
    if fail_after is None and stopped:
        assert statuses[7] == KVPoll.Failed and "release timeouts" in failures[7]
    return ret, len(calls)


def test_a_chunks_calls_stop_once_its_room_failed(monkeypatch):
    """Review finding (high): the calls of one chunk went on after its room failed, past the
    point where decode's release guard gives the pages back."""
    assert _chunk_calls(monkeypatch, fail_after=None) == (0, 10)
    assert _chunk_calls(monkeypatch, fail_after=3) == (transfer_bounds.STOPPED, 3)


def test_a_send_past_its_deadline_fails_its_room_and_stops(monkeypatch):
    """Not as a transport failure (upstream would blame the session and withhold the drain ack,
    though no call is left in flight): the room fails, as on an abort."""
    assert _chunk_calls(monkeypatch, fail_after=None, timeout_s=-1.0) == (transfer_bounds.STOPPED, 0)


def test_calls_after_a_send_ended_are_bounded_one_by_one_only(monkeypatch):
    """The aux write after a chunk's send (and any call on a thread with no send) is not stopped."""
    _chunk_calls(monkeypatch, fail_after=3)
    calls = []
    assert batch_transfer_sync(lambda *_a: calls.append(1) or 0, "peer", [0, 1], [0, 1], [1, 1],
                               bounds=Bounds(max_entries=1, max_bytes=1)) == 0 and len(calls) == 2
