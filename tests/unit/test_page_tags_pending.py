"""H8's check off decode's critical path: the torch path (what a GPU runs) starts the check when
the transfer succeeds and decode's loop reads the verdict only once the device has written it,
the request staying in the transfer queue meanwhile; the numpy path (CPU servers) is ready at
once. On CPU torch every event is done when recorded, so the device here is `LateDevice`, whose
events complete when the test says: a stand-in for a GPU still running the check."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch

from sglang_hardened.runtime.page_tags import seams
from sglang_hardened.runtime.page_tags.rows import DecodePageTags, HostSlots, PendingCount
from tests.unit.test_page_tags_seams import ROOM, decode_req, transfer_queue


@dataclass
class LateDevice:
    """Events that complete when `done` is set (or when waited for: `synchronize` counts a wait)."""

    done: bool = False
    waits: int = 0

    def Event(self) -> LateEvent:  # noqa: N802 (torch's device modules name it so)
        return LateEvent(self)


@dataclass
class LateEvent:
    device: LateDevice

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.device.done

    def synchronize(self) -> None:
        self.device.waits += 1
        self.device.done = True


@pytest.fixture
def aborted(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(seams, "abort_before_decode", lambda _req, reason: seen.append(reason))
    return seen


def queued(path: str, written: list[int]):
    """A request of three pages (2, 3, 4) whose transfer succeeded having written `written`, on
    a decode whose row path is `path` and whose device is late; the transfer queue it is in."""
    tags = DecodePageTags(16, path=path)
    device = LateDevice()
    tags.event = device.Event
    dreq = decode_req(tags, prompt=10)  # page size 4: slots 8..19 -> pages 2, 3, 4
    seams.allocate(dreq, [2, 3, 4])
    tags.buffer.stamp(written, ROOM, dreq.hardened_epoch)
    return tags, device, dreq, transfer_queue(torch.arange(8, 24).unsqueeze(0).clone())


@pytest.mark.parametrize("written, refused", [([2, 3, 4], None), ([2, 3], "1 of its 3 pages")])
def test_the_request_waits_in_the_queue_until_its_verdict_is_on_the_host(aborted, written, refused):
    """Polls before the device wrote the count skip the request (no wait, nothing decided, the
    check not started again); the first poll after it gets the verdict the numpy path gives."""
    tags, device, dreq, queue = queued("torch", written)
    assert seams.verdict_pending(queue, dreq)
    count = dreq.hardened_count
    assert isinstance(count, PendingCount)
    assert seams.verdict_pending(queue, dreq) and dreq.hardened_count is count
    assert tags.expected[ROOM] == dreq.hardened_epoch and not aborted and tags.mismatched_requests == 0
    device.done = True
    assert not seams.verdict_pending(queue, dreq)
    assert seams.refuse_untagged(dreq) == (refused is not None)
    assert device.waits == 0, "the loop waited for the device"
    assert (refused in aborted[0]) if refused else not aborted
    assert ROOM not in tags.expected and dreq.hardened_count is None  # released either way

    numpy_tags, _, numpy_req, numpy_queue = queued("numpy", written)
    assert not seams.verdict_pending(numpy_queue, numpy_req), "a CPU server's verdict is ready at once"
    assert seams.refuse_untagged(numpy_req) == (refused is not None)
    assert aborted[1:] == aborted[:1]  # the same refusal, word for word


def test_under_pipeline_parallelism_the_verdict_is_waited_for(aborted):
    """With PP the stages agree which requests leave a poll before any checks them: a stage
    that skipped one would diverge, so there the loop waits, as it did before."""
    _, device, dreq, queue = queued("torch", [2, 3, 4])
    assert not seams.verdict_pending(queue, dreq, rids_to_check=["r"])
    assert device.waits == 1 and not seams.refuse_untagged(dreq) and not aborted


def test_a_request_released_while_pending_keeps_its_slot_until_the_copy_lands(monkeypatch):
    """Aborted while its verdict is on the way, a request is released as any queued one (its
    epoch forgotten, its pages vouching for nobody); its host slot is reused only once the copy
    into it has landed, so a later check cannot read the dropped one's count."""
    monkeypatch.setattr(HostSlots, "GROW", 1)
    tags, device, dreq, queue = queued("torch", [2, 3, 4])
    assert seams.verdict_pending(queue, dreq)
    first = dreq.hardened_count._slot[0].data_ptr()
    seams.release(dreq)
    gc.collect()
    assert ROOM not in tags.expected and dreq.hardened_count is None
    assert tags.buffer.rows[2].tolist() == [-1, -1]
    other = tags.start_check(ROOM + 1, [5])
    assert other._slot[0].data_ptr() != first  # the dropped one's copy may still land there
    device.done = True
    assert tags.start_check(ROOM + 2, [6])._slot[0].data_ptr() == first


def test_a_count_read_before_the_event_waits_for_it():
    """`check` runs both halves at once: it waits (the tests' and the prefill peer's form)."""
    tags = DecodePageTags(8, path="torch")
    device = LateDevice()
    tags.event = device.Event
    tags.allocate(3, [1])
    assert tags.check(3, [1]) is not None and device.waits == 1


@pytest.mark.parametrize("path", ["torch", "numpy"])
@pytest.mark.parametrize("written, refused", [([2, 3, 4], None), ([2, 3], "1 of its 3 pages")])
def test_a_request_that_skipped_the_pending_seam_is_checked_not_crashed(aborted, path, written, refused):
    """A path to `_commit_transfer_to_req` past `pop_transferred`'s seam started no verdict: the
    commit seam checks the request's pages itself, waiting for the device, and refuses or admits
    as the two halves would, instead of raising in decode's loop."""
    tags, device, dreq, _ = queued(path, written)
    assert seams.refuse_untagged(dreq) == (refused is not None)
    assert (refused in aborted[0]) if refused else not aborted
    assert device.waits == (path == "torch") and ROOM not in tags.expected


def test_pages_handed_out_again_drop_a_room_never_released():
    """A request refused before H8's seam (H3, a room mismatch) or a failed transfer released at
    once never reaches the release seam; when its pages go to another request, its epoch and
    pages go: nothing of it stays for the server's life."""
    tags = DecodePageTags(16, path="numpy")
    refused = decode_req(tags, prompt=10)
    seams.allocate(refused, [2, 3, 4])  # then refused by H3: no release
    other = decode_req(tags, prompt=10)
    other.req.bootstrap_room = ROOM + 1
    seams.allocate(other, [4, 5])
    assert tags.expected == {ROOM + 1: other.hardened_epoch} and list(tags._allocated) == [ROOM + 1]
    assert tags.check(ROOM + 1, [4, 5]) is not None  # the new room's rows are unstamped, as allocated


@pytest.mark.parametrize("path", ["torch", "numpy"])
def test_allocations_never_released_stay_bounded_by_the_pool(path):
    """Rooms allocated and never released, over a pool of 8 pages: the tables hold at most a room
    per page, and a later room's allocation of other pages is left alone."""
    tags = DecodePageTags(8, path=path)
    kept = tags.allocate(10_000, [7])
    for room in range(500):
        tags.allocate(room, [room % 7, (room + 3) % 7])
        assert len(tags.expected) <= 8 and len(tags._allocated) <= 8
    assert tags.expected[10_000] == kept
    tags.buffer.stamp([7], 10_000, kept)
    assert tags.check(10_000, [7]) is None
