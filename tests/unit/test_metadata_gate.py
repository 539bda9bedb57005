"""H13: the metadata gate holds a concluded transfer whose row has not landed for at most
decode's release timeout, then fails it with the cause where upstream's failure path reads it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_hardened.runtime.metadata_gate import held
from sglang_hardened.runtime.release_timeout import RELEASE_TIMEOUT_ENV, process_release_timeout_s


class KVPoll:  # upstream's poll values (disaggregation/base/conn.py, every base)
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@pytest.fixture(autouse=True)
def release_timeout_30s(monkeypatch):
    monkeypatch.setenv(RELEASE_TIMEOUT_ENV, "30")
    process_release_timeout_s.cache_clear()
    yield
    process_release_timeout_s.cache_clear()


class Manager:
    def __init__(self):
        self.failure_records: dict[int, str] = {}

    def record_failure(self, room: int, reason: str) -> None:
        self.failure_records[room] = reason


def decode_request() -> SimpleNamespace:
    receiver = SimpleNamespace(kv_mgr=Manager(), bootstrap_room=77, conclude_state=KVPoll.Success)
    return SimpleNamespace(kv_receiver=receiver)


def test_held_as_upstream_holds_it_until_the_release_timeout_from_the_first_hold():
    req = decode_request()
    assert held(req, KVPoll, now=100.0) == KVPoll.Transferring
    assert held(req, KVPoll, now=129.9) == KVPoll.Transferring  # counted from the first hold, not this one
    assert req.kv_receiver.conclude_state == KVPoll.Success and not req.kv_receiver.kv_mgr.failure_records


def test_then_failed_with_the_cause_recorded_for_the_500():
    req = decode_request()
    held(req, KVPoll, now=100.0)
    assert held(req, KVPoll, now=130.0) == KVPoll.Failed
    receiver = req.kv_receiver
    assert receiver.conclude_state == KVPoll.Failed  # every later poll of the receiver says Failed too
    reason = receiver.kv_mgr.failure_records[77]
    assert reason.startswith("sglang-hardened H13:") and "bootstrap room 77" in reason
    assert "did not reach decode within 30 s" in reason and RELEASE_TIMEOUT_ENV in reason


def test_each_request_has_its_own_clock():
    first, second = decode_request(), decode_request()
    held(first, KVPoll, now=0.0)
    assert held(second, KVPoll, now=40.0) == KVPoll.Transferring
    assert held(first, KVPoll, now=40.0) == KVPoll.Failed
