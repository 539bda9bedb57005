"""H5 on prefill (sglang_hardened.runtime.source_hold): a failed request keeps its source
pages while the transfer worker still reads them, for at most two release timeouts.

The seam reads two attributes of upstream's KV sender (stand-in: a real sender needs a
whole KV manager and transfer engine; tests/e2e/test_fault_matrix.py runs the real one).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import nixl_drain, source_hold


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sender:
    """What the seam reads of upstream's KV sender (a plain class, as upstream's is)."""

    def __init__(self, room: int, in_flight: int | None) -> None:
        self.bootstrap_room = room
        self.kv_mgr = SimpleNamespace(_staging_outstanding={room: in_flight}) if in_flight is not None else None


@pytest.fixture
def timeout_s(monkeypatch) -> float:
    monkeypatch.setattr(source_hold, "process_release_timeout_s", lambda: 8.0)
    return 8.0


def test_nothing_in_flight_releases_at_once(timeout_s):
    assert not source_hold.still_sending(Sender(1, 0))
    assert not source_hold.still_sending(Sender(2, None)), "a warm-up sender has no transfer worker"


def test_held_while_a_chunk_is_in_flight_then_released_when_it_returns(timeout_s, caplog):
    clock, sender = Clock(), Sender(3, 1)
    with caplog.at_level(logging.INFO, logger="sglang_hardened"):
        assert source_hold.still_sending(sender, clock=clock)
        clock.now += source_hold.HOLD_TIMEOUTS * timeout_s - 1
        assert source_hold.still_sending(sender, clock=clock)
        sender.kv_mgr._staging_outstanding[3] = 0
        assert not source_hold.still_sending(sender, clock=clock)
    assert [r.message.count("room 3") for r in caplog.records] == [1, 1], "one line when held, one when released"


def test_a_transfer_that_never_returns_is_released_after_the_timeout_for_good(timeout_s):
    clock, sender = Clock(), Sender(4, 1)
    assert source_hold.still_sending(sender, clock=clock)
    clock.now += source_hold.HOLD_TIMEOUTS * timeout_s
    assert not source_hold.still_sending(sender, clock=clock)
    clock.now += 1
    assert not source_hold.still_sending(sender, clock=clock), "an expired hold does not start again"


def test_a_release_outside_the_queue_waits_for_the_transfer_and_runs_once(timeout_s):
    """An aborted chunked request: released at once with nothing in flight; else parked (the
    request reads as retired, the scheduler as busy) until the chunk returns."""
    released: list[str] = []
    source_hold.release_when_sent("idle", Sender(4, 0), lambda: released.append("idle"))
    source_hold.release_when_sent("warm-up", None, lambda: released.append("warm-up"))
    assert released == ["idle", "warm-up"] and not source_hold.parked()
    clock, sender, req = Clock(), Sender(5, 1), object()
    source_hold.release_when_sent(req, sender, lambda: released.append("req"), clock=clock)
    source_hold.release_when_sent(req, sender, lambda: released.append("again"), clock=clock)  # a second retire
    assert source_hold.parked(req) and source_hold.parked()
    source_hold.release_parked(clock=clock)
    assert released == ["idle", "warm-up"], "released while the chunk still reads its pages"
    sender.kv_mgr._staging_outstanding[5] = 0
    source_hold.release_parked(clock=clock)
    source_hold.release_parked(clock=clock)
    assert released == ["idle", "warm-up", "req"] and not source_hold.parked()


def test_a_parked_release_runs_when_its_hold_runs_out(timeout_s, caplog):
    released: list[str] = []
    clock, req = Clock(), object()
    source_hold.release_when_sent(req, Sender(6, 1), lambda: released.append("req"), clock=clock)
    clock.now += source_hold.HOLD_TIMEOUTS * timeout_s - 1
    source_hold.release_parked(clock=clock)
    assert not released
    clock.now += 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_hardened"):
        source_hold.release_parked(clock=clock)
    assert released == ["req"] and not source_hold.parked(req)
    assert [r.levelno for r in caplog.records if "room 6" in r.message] == [logging.WARNING], \
        "a release the bound forced, under a write that may still read the pages, is a warning"


def test_a_room_the_nixl_watcher_holds_stays_held_after_the_worker_popped_its_count(timeout_s):
    """Found by a soak (hardened 0.5.23 NIXL): a cached prompt's prefix went as a chunk of its
    own, its write hung behind a stopped decode and was given up on (``nixl_drain`` took the
    room); the worker then skipped the room's last chunk, which pops the room's whole count, so
    the hold let go and the prefix pages were evicted 0.9 s before the write reading them
    settled. The watcher's own threads and state, with a stand-in NIXL agent."""
    state = {"handle": "PROC"}  # the given-up write, as the transport reports it
    acks: list[int] = []
    sender = Sender(7, 1)
    sender.kv_mgr = manager = SimpleNamespace(
        _staging_outstanding=sender.kv_mgr._staging_outstanding, enable_deferred_decode_kv_release=True,
        agent=SimpleNamespace(check_xfer_state=state.get), conclude_failure=lambda **_: None,
        _maybe_ack_drained_abort=acks.append)
    assert nixl_drain.take_unsettled(manager, 7, ["handle"], "given up at the release timeout")
    manager._staging_outstanding.pop(7)  # the worker's skip of the room's next chunk
    assert source_hold.still_sending(sender)
    state["handle"] = "DONE"
    deadline = time.monotonic() + 10
    while not acks and time.monotonic() < deadline:
        time.sleep(nixl_drain.POLL_S)
    assert acks == [7] and not source_hold.still_sending(sender)
