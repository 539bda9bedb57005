"""H6 on NIXL (sglang_hardened.runtime.transfer_deadline): a wait on posted handles ends at the
release timeout, and handles given up on are watched until they settle.

The agent here answers check_xfer_state from a dict (stand-in: a NIXL write that never settles
needs a stopped UCX peer; tests/e2e/test_fault_matrix.py stops a real decode mid-write).
"""

from __future__ import annotations

import logging
import time

import pytest

from sglang_hardened.runtime import transfer_deadline
from sglang_hardened.runtime.transfer_deadline import TransferDeadline, Wait


class Agent:
    def __init__(self, **states: str) -> None:
        self.states = states

    def check_xfer_state(self, handle: str) -> str:
        return self.states[handle]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def timeout_s(monkeypatch) -> float:
    monkeypatch.setattr(transfer_deadline, "process_release_timeout_s", lambda: 8.0)
    monkeypatch.setattr(transfer_deadline, "WATCH_INTERVAL_S", 0.01)
    return 8.0


def _logged(caplog, text: str, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not (n := sum(text in r.getMessage() for r in caplog.records)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_a_wait_is_healthy_until_the_release_timeout(timeout_s):
    clock = Clock()
    wait = Wait(Agent(h="PROC"), ["h"], clock=clock)
    clock.now = timeout_s - 0.1
    assert not wait.expired()
    wait.check()


def test_past_the_deadline_it_fails_once_and_watches_the_handles_until_they_settle(timeout_s, caplog):
    clock, agent = Clock(), Agent(a="DONE", b="PROC")
    wait = Wait(agent, ["a", "b"], clock=clock)
    clock.now = timeout_s
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert wait.expired() and wait.expired(), "stays expired"
        with pytest.raises(TransferDeadline, match="release timeout"):
            wait.check()
        assert _logged(caplog, "has not settled after 8 s") == 1, "logged once"
        time.sleep(0.1)
        assert not _logged(caplog, "given up on settled", timeout_s=0), "b is still running"
        agent.states["b"] = "ERR"
        assert _logged(caplog, "given up on settled") == 1


def test_an_agent_that_cannot_be_read_ends_the_watch(timeout_s, caplog):
    clock = Clock()
    wait = Wait(Agent(), ["gone"], clock=clock)  # KeyError: the agent no longer knows the handle
    clock.now = timeout_s
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert wait.expired()
        assert _logged(caplog, "can no longer be read") == 1
