"""H8 on NIXL 0.5.23 (sglang_hardened.runtime.page_tags.nixl): a lane's wait for its earlier
tag writes before it restamps (the shared-prefix fix) must not let one stalled decode stop the lane.

Stand-in: the agent's write states are set by the test (a write that stays in flight needs a
stalled peer; tests/integration/test_page_tags_transfer.py runs the same seam over real NIXL UCX).
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import nixl_drain
from sglang_hardened.runtime.page_tags import nixl as page_tags_nixl
from sglang_hardened.runtime.page_tags.rows import SourceTags

TIMEOUT_S = 0.3


class Agent:
    """What `send_tags` calls of a NIXL agent; every write to `stalled` stays in flight."""

    def __init__(self, stalled: str) -> None:
        self.stalled, self.posted, self.polls = stalled, {}, 0
        self._ids = itertools.count()

    def get_xfer_descs(self, table, kind):
        return table

    def initialize_xfer(self, op, src, dst, peer):
        handle = f"h{next(self._ids)}"
        self.posted[handle] = peer
        return handle

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        self.polls += 1
        return "PROC" if self.posted[handle] == self.stalled else "DONE"


@pytest.fixture
def manager(monkeypatch):
    monkeypatch.setattr(nixl_drain, "process_release_timeout_s", lambda: TIMEOUT_S)
    mgr = SimpleNamespace(agent=Agent(stalled="decode-a"), enable_deferred_decode_kv_release=True,
                          kv_args=SimpleNamespace(gpu_id=0), hardened_tags=SourceTags(8, lanes=1),
                          hardened_tag_writes={},
                          decode_kv_args_table={peer: SimpleNamespace(hardened_h8=4096, gpu_id=0)
                                                for peer in ("decode-a", "decode-b")})
    return mgr


def send(mgr, room: int, peer: str) -> tuple[list, float]:
    """One chunk of pages 0-1 of `room` to `peer` (0.5.23's path: the write joins `handles`)."""
    chunk = SimpleNamespace(prefill_kv_indices=[0, 1])
    req = SimpleNamespace(room=room, hardened_h8=1, agent_name=peer)
    handles, t0 = [], time.monotonic()
    page_tags_nixl.send_tags(mgr, chunk, req, [2, 3], handles)
    return handles, time.monotonic() - t0


def test_a_stalled_decode_costs_the_lane_one_wait_not_every_later_room(manager):
    """Whether a send waited is told by its polls, not the clock: a wait polls until the timeout."""
    send(manager, 1, "decode-a")  # its tag write never settles: decode-a is stalled
    handles, waited = send(manager, 2, "decode-b")  # restamping waits for room 1's write, once
    assert handles and TIMEOUT_S <= waited
    for room in (3, 4):  # other values again: room 2's write settled, room 1's is not awaited again
        polls = manager.agent.polls
        handles, _ = send(manager, room, "decode-b")
        assert handles and manager.agent.polls - polls == 1  # the room before's write, found DONE


def test_the_same_rooms_next_chunk_does_not_wait_for_its_first(manager):
    send(manager, 1, "decode-a")
    handles, _ = send(manager, 1, "decode-a")
    assert handles and manager.agent.polls == 0  # no write polled: no wait
    assert len(manager.hardened_tag_writes[id(manager.hardened_tags.lane())][1]) == 2
