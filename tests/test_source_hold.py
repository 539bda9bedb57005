"""H5 on prefill (sglang_hardened.runtime.source_hold): a failed request keeps its source
pages while the transfer worker still reads them, for at most two release timeouts.

The seam reads two attributes of upstream's KV sender (stand-in: a real sender needs a
whole KV manager and transfer engine; tests/e2e/test_fault_matrix.py runs the real one).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import source_hold


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
        assert source_hold.still_sending(sender, clock)
        clock.now += source_hold.HOLD_TIMEOUTS * timeout_s - 1
        assert source_hold.still_sending(sender, clock)
        sender.kv_mgr._staging_outstanding[3] = 0
        assert not source_hold.still_sending(sender, clock)
    assert [r.message.count("room 3") for r in caplog.records] == [1, 1], "one line when held, one when released"


def test_a_transfer_that_never_returns_is_released_after_the_timeout_for_good(timeout_s):
    clock, sender = Clock(), Sender(4, 1)
    assert source_hold.still_sending(sender, clock)
    clock.now += source_hold.HOLD_TIMEOUTS * timeout_s
    assert not source_hold.still_sending(sender, clock)
    clock.now += 1
    assert not source_hold.still_sending(sender, clock), "an expired hold does not start again"
