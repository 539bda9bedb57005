"""The page ledger takes a NIXL write's end from the transport, never from the code it judges;
and it tells which prefill slots each position decode attends to came from.

Review finding: for a write hardened prefill gave up on, the ledger's "write ended"
event was the hardened runtime's own "settled" log line, so a runtime that said so too early
would have passed. Here the ledger runs in one process against a stand-in NIXL agent (the test
environment has no NIXL): the runtime's notice, made early on purpose, ends nothing, and a
page decode frees before the transport reports the write DONE is judged unsafe.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from sglang_hardened.sandbox.env import overlay_module
from sglang_hardened.sandbox.ledger import Ledger

ROOM, PAGES = 7, list(range(16))


class Agent:
    """A stand-in ``nixl._api.nixl_agent``: reports each handle PROC until the test settles it."""

    settled: dict[object, str] = {}

    def check_xfer_state(self, handle) -> str:
        return self.settled.get(handle, "PROC")


class Manager:
    agent = Agent()

    def send_kvcache(self, *_args) -> object:
        return object()  # a posted transfer's handle


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    """A fresh ledger writer recording into ``tmp_path``, with NIXL stood in."""
    nixl_api = types.ModuleType("nixl._api")
    nixl_api.nixl_agent = Agent
    monkeypatch.setitem(sys.modules, "nixl._api", nixl_api)
    monkeypatch.setattr(Agent, "settled", {})
    monkeypatch.setattr(Agent, "check_xfer_state", Agent.__dict__["check_xfer_state"])
    writer = overlay_module("sgl_ledger")
    monkeypatch.setenv(writer.DIR_ENV, str(tmp_path))
    writer.exposed(ROOM, PAGES, len(PAGES))  # decode's side: from here on these pages may be written
    return writer


def _post(writer) -> object:
    manager = Manager()
    return writer.posting(types.SimpleNamespace(room=ROOM), PAGES, manager.send_kvcache)(
        "peer", list(range(16)), [0], PAGES)


def test_the_runtimes_early_settled_notice_does_not_end_the_write(ledger, tmp_path):
    handle = _post(ledger)
    logging.getLogger("sglang_hardened").warning(
        "sglang-hardened H5: room %s: the NIXL writes given up on settled 0.0 s later; its drain ack goes out",
        ROOM, extra={"settled_room": ROOM})  # the notice the ledger used to take as the end
    Manager.agent.check_xfer_state(handle)  # the transport still reports PROC
    ledger.freed_pages(PAGES)
    unsafe = Ledger(tmp_path).unsafe_frees()
    assert {u.page for u in unsafe} == set(PAGES), unsafe
    Agent.settled[handle] = "DONE"
    assert Manager.agent.check_xfer_state(handle) == "DONE"
    assert all(u.write_end > u.freed_at for u in Ledger(tmp_path).unsafe_frees())  # the free came first


def test_a_free_after_the_transport_reports_done_is_safe(ledger, tmp_path):
    handle = _post(ledger)
    Agent.settled[handle] = "DONE"
    assert Manager.agent.check_xfer_state(handle) == "DONE"
    ledger.freed_pages(PAGES)
    assert not Ledger(tmp_path).unsafe_frees()
    [end] = Ledger(tmp_path).of("end")
    assert end["rc"] == "DONE" and end["room"] == ROOM


def test_a_rejected_post_ends_nothing_until_its_writes_on_the_wire_land(ledger, tmp_path):
    """ERR may leave writes on the wire (0.5.23's rejected-post rule); a fault stand-in that made
    such writes says when they landed."""
    handle = _post(ledger)
    Agent.settled[handle] = "ERR"
    assert Manager.agent.check_xfer_state(handle) == "ERR"
    assert not Ledger(tmp_path).of("end")
    ledger.landed(ROOM)
    ledger.freed_pages(PAGES)
    assert not Ledger(tmp_path).unsafe_frees()


def test_a_page_sent_whole_carries_slots_prefill_held_for_another_room(ledger, tmp_path, monkeypatch):
    """The review's same-page case, in one process: prefill holds 6 positions of room B (pages of 4),
    sends its two pages whole, and decode attends to 9 positions. Position 6 and 7 come from
    slots room A held before; position 8's page no write covered. Each Mooncake engine call
    under the send is recorded with what it carried."""

    class Engine:  # a stand-in ``mooncake.engine.TransferEngine``: every call succeeds
        def batch_transfer_sync_write(self, peer, srcs, dsts, lengths) -> int:
            return 0

    monkeypatch.setitem(sys.modules, "mooncake.engine", types.SimpleNamespace(TransferEngine=Engine))
    room_a, room_b = 3, 9
    ledger.owns(room_a, range(8), 4)
    ledger.owns(room_b, range(6), 4)  # B reuses A's slots 0-5 (A ended); 6 and 7 still hold A's KV
    ledger.exposed(room_b, [10, 11, 12], 9)

    def send(session, src_pages, dst_ptrs, dst_pages) -> int:
        return Engine().batch_transfer_sync_write(session, [1, 2], [3, 4], [64, 32])

    assert ledger.writing(types.SimpleNamespace(room=room_b), [10, 11], send)("peer", [0, 1], [0], [10, 11]) == 0
    judged = Ledger(tmp_path)
    assert [(r.position, r.slot, r.owner) for r in judged.unowned_reads(room_b)] == [
        (6, 6, room_a), (7, 7, room_a), (8, None, None)]
    [call] = judged.calls(room_b)
    assert (call["entries"], call["bytes"], call["longest"], call["rc"]) == (2, 96, 64, 0)


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path):
    (tmp_path / "7.jsonl").write_text('{"t": 1.0, "ev": "begin", "room": 1, "w": 1, "pages": [3]}\n{"t": 2.0, "ev": "en')
    assert [e["ev"] for e in Ledger(tmp_path).events] == ["begin"]
