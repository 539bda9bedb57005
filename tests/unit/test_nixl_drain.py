"""H5/H6 on NIXL (sglang_hardened.runtime.nixl_drain): a failed room's drain ack waits for the
writes the worker gave up on.

Stand-in: the agent's handle states are set by the test (a write that stays in flight needs a
stalled peer; tests/e2e/test_fault_matrix.py's decode-stopped case stops a real one over UCX
TCP), and the manager keeps upstream's ack order: the seam, then the count, then the targets.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import nixl_drain
from tests.harness import eventually


class Agent:
    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.broken = False

    def check_xfer_state(self, handle: str) -> str:
        if self.broken:
            raise RuntimeError("agent gone")
        return self.states[handle]


class Manager:
    """What the watcher and the seams touch of upstream's NIXL KV manager."""

    def __init__(self, deferred: bool = True) -> None:
        self.agent = Agent()
        self.enable_deferred_decode_kv_release = deferred
        self._staging_outstanding: dict[int, int] = {}
        self._deferred_ack_targets: dict[int, list[str]] = {}
        self.acks: list[tuple[int, str]] = []
        self.failures: list[tuple[int, str]] = []

    def _maybe_ack_drained_abort(self, room: int) -> None:  # upstream's order, the seam first
        if nixl_drain.holds(self, room) or self._staging_outstanding.get(room, 0) > 0:
            return
        self.acks += [(room, t) for t in self._deferred_ack_targets.pop(room, [])]

    def conclude_failure(self, *, bootstrap_room: int, failure_reason: str) -> None:
        self.failures.append((bootstrap_room, failure_reason))


@pytest.fixture
def timeout_s(monkeypatch) -> float:
    monkeypatch.setattr(nixl_drain, "process_release_timeout_s", lambda: 0.5)
    return 0.5


def test_an_unsettled_room_is_failed_at_once_and_acked_only_when_its_writes_settle(timeout_s, caplog):
    mgr = Manager()
    mgr.agent.states = {"kv": "PROC", "aux": "DONE"}
    mgr._staging_outstanding[7] = 1  # the chunk given up on stays counted
    assert nixl_drain.take_unsettled(mgr, 7, ["kv", "aux"], "not settled within the release timeout")
    assert mgr.failures == [(7, "not settled within the release timeout")], "decode is told at once"
    mgr._deferred_ack_targets[7] = ["decode-0"]  # decode's ABORT arrives, and a skip path pops the count
    mgr._staging_outstanding.pop(7)
    mgr._maybe_ack_drained_abort(7)
    time.sleep(timeout_s)
    assert mgr.acks == [] and nixl_drain.holds(mgr, 7), "acked while a write may still land"
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        mgr.agent.states["kv"] = "ERR"  # a handle that failed has settled too
        assert eventually(lambda: mgr.acks == [(7, "decode-0")])
    assert not nixl_drain.holds(mgr, 7) and 7 not in mgr._staging_outstanding
    [settled] = [r for r in caplog.records if "room 7: the NIXL writes given up on settled" in r.getMessage()]
    assert settled.levelno == logging.WARNING


def test_an_ack_target_registered_after_the_settle_is_acked_by_upstream_at_once(timeout_s):
    mgr = Manager()
    mgr.agent.states = {"kv": "DONE"}
    mgr._staging_outstanding[3] = 1
    nixl_drain.take_unsettled(mgr, 3, ["kv"], "settle timeout")
    assert eventually(lambda: not nixl_drain.holds(mgr, 3))
    mgr._deferred_ack_targets[3] = ["decode-0"]
    mgr._maybe_ack_drained_abort(3)
    assert mgr.acks == [(3, "decode-0")]


def test_a_rejected_post_is_acked_one_release_timeout_after_its_handles_settled(timeout_s):
    mgr = Manager()
    mgr.agent.states = {"kv": "DONE"}
    mgr._deferred_ack_targets[5] = ["decode-0"]
    started = time.monotonic()
    nixl_drain.take_rejected(mgr, 5, ["kv"])
    mgr._maybe_ack_drained_abort(5)  # upstream's own attempt right after the rejection
    assert eventually(lambda: mgr.acks == [(5, "decode-0")])
    # an order, not "no ack yet" just after: a slow host may reach that line past the timeout
    assert time.monotonic() - started >= timeout_s, "acked before the release timeout (by upstream's attempt?)"


def test_a_handle_that_cannot_be_read_keeps_the_ack_back(timeout_s, caplog):
    mgr = Manager()
    mgr.agent.states = {"kv": "PROC"}
    mgr.agent.broken = True
    mgr._deferred_ack_targets[9] = ["decode-0"]
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        nixl_drain.take_unsettled(mgr, 9, ["kv"], "settle timeout")
        time.sleep(timeout_s)
    assert nixl_drain.holds(mgr, 9) and mgr.acks == []
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1, "logged once"


def test_without_deferred_release_upstream_keeps_its_unbounded_wait_and_its_own_path(timeout_s):
    mgr = Manager(deferred=False)
    assert nixl_drain.deadline(mgr) == float("inf")
    assert not nixl_drain.take_unsettled(mgr, 4, ["kv"], "settle timeout")
    assert mgr.failures == [] and not nixl_drain.holds(mgr, 4)


def test_the_healthy_wait_ends_at_the_release_timeout(timeout_s, monkeypatch):
    """On a clock the test sets: "not passed yet" on the real one holds only if the next line runs
    within the 0.5 s timeout."""
    clock = [100.0]
    monkeypatch.setattr(nixl_drain, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    until = nixl_drain.deadline(Manager())
    assert until == 100.5  # now + the 0.5 s release timeout
    clock[0] = 100.499
    assert not nixl_drain.passed(until)
    clock[0] = 100.5
    assert nixl_drain.passed(until)



def test_0_5_19s_failure_path_acks_once_the_handles_settled_and_a_timeout_passed(timeout_s):
    """0.5.19 sends every error (a rejected post among them) to one path that never acked."""
    mgr = Manager()
    mgr.agent.states = {"kv": "DONE"}
    mgr._staging_outstanding[6] = 1
    mgr._deferred_ack_targets[6] = ["decode-0"]
    failed_at = time.monotonic()
    nixl_drain.take_failed(mgr, 6, ["kv"])
    assert eventually(lambda: mgr.acks == [(6, "decode-0")])
    assert time.monotonic() - failed_at >= timeout_s, "acked before a rejected post's writes had a timeout"
    mgr.agent.states["kv2"] = "PROC"
    nixl_drain.take_failed(mgr, 16, ["kv2"])
    time.sleep(timeout_s * 1.5)
    assert nixl_drain.holds(mgr, 16), "released while a handle is still in flight"
