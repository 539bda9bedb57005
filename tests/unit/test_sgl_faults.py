"""The overlay's injected page faults (tests/cpu_overlay/site/sgl_faults.py) against stand-ins:
each hits only long transfers and only when switched on, and keeps the allocator's books
(every page freed once, the request's page table holding only pages it owns)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_hardened.sandbox.env import overlay_module
from tests.harness import eventually

faults = overlay_module("sgl_faults")
PAGE = 2


class Allocator:
    """A paged allocator's free list: pages out from the front, back at the end."""

    page_size = PAGE

    def __init__(self, pages: int) -> None:
        self.free_pages = list(range(1, pages))
        self.freed: list[int] = []

    def alloc(self, need: int):
        if not self.free_pages:
            return None
        page = self.free_pages.pop(0)
        return page * PAGE + torch.arange(need, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        pages = sorted({int(s) // PAGE for s in slots})
        assert not set(pages) & set(self.free_pages), "freed twice"
        self.freed += pages
        self.free_pages += pages


def request(pages: list[int], tokens: int):
    """A decode request whose page table holds ``pages`` for a ``tokens``-token prompt."""
    row = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int32)
    pool = SimpleNamespace(req_to_token=row.unsqueeze(0).clone())
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0), origin_input_ids=list(range(tokens)), bootstrap_room=7)
    return pool, SimpleNamespace(req=req)


@pytest.fixture
def switch(tmp_path, monkeypatch):
    path = tmp_path / "fault"
    path.write_text("")
    monkeypatch.setenv(faults.FILE_ENV, str(path))
    monkeypatch.setattr(faults, "MIN_PAGES", 3)
    return path


def test_drop_last_page_only_when_switched_on_and_long(switch):
    sent = []
    send = faults.dropping_last_page(SimpleNamespace(room=7), lambda *a, **k: sent.append(a) or 0)
    send("s", [1, 2, 3], "ptrs", [4, 5, 6], "executor")
    switch.write_text("drop-last-page")
    send("s", [1, 2], "ptrs", [4, 5], "executor")  # under the floor
    send("s", [1, 2, 3], "ptrs", [4, 5, 6], "executor")
    assert [(a[1], a[3]) for a in sent] == [([1, 2, 3], [4, 5, 6]), ([1, 2], [4, 5]), ([1, 2], [4, 5])]


class AuxManager:
    """Upstream's Mooncake manager as far as the aux path goes: ``send_aux_tcp`` frames each
    buffer through ``send_aux_data_to_endpoint``, which writes ``len(data)`` into the frame."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes]] = []

    def send_aux(self, req, prefill_aux_index, dst_aux_ptrs):
        return "rdma"

    def send_aux_tcp(self, req, prefill_aux_index, dst_aux_ptrs):
        for i, data in enumerate((b"first token", b"room")):
            self.send_aux_data_to_endpoint(remote="d", dst_port=1, room=req.room, buffer_index=i,
                                           aux_index=0, data=data)
        return 0

    def send_aux_data_to_endpoint(self, *, remote, dst_port, room, buffer_index, aux_index, data) -> None:
        self.frames.append((len(data), bytes(data)))


def test_aux_cut_sends_frames_one_byte_short_of_their_length_and_reports_success(switch):
    manager, req = AuxManager(), SimpleNamespace(room=9, dst_kv_indices=list(range(4)))
    assert faults.cutting_aux(req, manager)(req, 0, [1, 2]) == "rdma" and not manager.frames
    switch.write_text("aux-cut")
    assert faults.cutting_aux(SimpleNamespace(room=9, dst_kv_indices=[1]), manager) == manager.send_aux  # short
    assert faults.cutting_aux(req, manager)(req, 0, [1, 2]) == 0
    assert manager.frames == [(12, b"first token"), (5, b"room")]  # each length field says one more than it carries


def test_fail_part_way_writes_half_then_reports_failure(switch):
    sent = []
    send = faults.failing_part_way(SimpleNamespace(room=7), lambda *a, **k: sent.append(a) or 0)
    assert send("s", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], "executor") == 0
    switch.write_text("fail-part-way")
    assert send("s", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], "executor") == -1
    assert [(a[1], a[3]) for a in sent] == [([1, 2, 3, 4], [5, 6, 7, 8]), ([1, 2], [5, 6])]


class NixlSender:
    """Stand-in for NIXL's manager (no UCX here): its post returns a handle that settles on the
    second look; tests/e2e/test_fault_matrix.py runs the fault on real NIXL."""

    def __init__(self) -> None:
        self.posted: list[tuple] = []
        self.looks = 0
        self.agent = SimpleNamespace(check_xfer_state=self._state)

    def _state(self, handle) -> str:
        self.looks += 1
        return "DONE" if self.looks > 1 else "PROC"

    def send_kvcache(self, peer, src, ptrs, dst, gpu_id, dst_mem_kind="VRAM"):
        self.posted.append((src, dst, dst_mem_kind))
        return len(self.posted)


def test_fail_part_way_on_nixl_posts_half_lets_it_land_then_raises(switch, tmp_path, monkeypatch):
    ledger = overlay_module("sgl_ledger")
    monkeypatch.setitem(sys.modules, "sgl_ledger", ledger)
    monkeypatch.setenv(ledger.DIR_ENV, str(tmp_path))
    sender = NixlSender()
    post = faults.failing_part_way_nixl(SimpleNamespace(room=7), sender.send_kvcache)
    assert post("peer", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], 0, dst_mem_kind="DRAM") == 1
    switch.write_text("fail-part-way")
    with pytest.raises(RuntimeError, match="SANDBOX PAGE FAULT fail-part-way: room 7"):
        post("peer", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], 0, dst_mem_kind="DRAM")
    assert sender.posted == [([1, 2, 3, 4], [5, 6, 7, 8], "DRAM"), ([1, 2], [5, 6], "DRAM")]
    assert sender.looks == 2, "the half write was waited for until it settled"
    [record] = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert (record["ev"], record["room"]) == ("end", 7), "the ledger saw the half write end"


class Agent:
    """A NIXL agent whose posts are accepted."""

    def __init__(self, state) -> None:
        self.check_xfer_state = state

    def transfer(self, handle) -> str:
        return "PROC"


class PostingSender(NixlSender):
    """A stand-in whose post goes through its agent's `transfer`, as upstream's `send_kvcache` does."""

    def __init__(self) -> None:
        super().__init__()
        self.agent = Agent(self._state)

    def send_kvcache(self, peer, src, ptrs, dst, gpu_id, dst_mem_kind="VRAM"):
        if self.agent.transfer(len(self.posted) + 1) == "ERR":
            raise Exception("KVSender failed to post transfer")
        return super().send_kvcache(peer, src, ptrs, dst, gpu_id, dst_mem_kind)


def test_post_rejected_on_nixl_raises_what_the_base_raises_and_lands_half_later(switch, tmp_path, monkeypatch):
    ledger = overlay_module("sgl_ledger")
    monkeypatch.setitem(sys.modules, "sgl_ledger", ledger)
    monkeypatch.setenv(ledger.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(faults, "LATE_S", 0.2)
    sender = PostingSender()
    post = faults.rejecting_post_nixl(SimpleNamespace(room=7), sender, sender.send_kvcache)
    assert post("peer", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], 0) == 1
    switch.write_text("post-rejected")
    with pytest.raises(Exception, match="KVSender failed to post transfer"):
        post("peer", [1, 2, 3, 4], "ptrs", [5, 6, 7, 8], 0)
    assert sender.agent.transfer(0) == "PROC", "the agent's own transfer is back"
    assert sender.posted == [([1, 2, 3, 4], [5, 6, 7, 8], "VRAM")], "nothing of the rejected post yet"
    def records() -> list[dict]:  # the ledger's file exists a moment before its line is written
        return [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]

    assert eventually(lambda: len(sender.posted) == 2 and records())
    assert sender.posted[1] == ([1, 2], [5, 6], "VRAM"), "its first half landed late"
    [record] = records()
    assert (record["ev"], record["room"]) == ("end", 7), "the ledger saw the late half end"


@pytest.mark.parametrize("fault", ["page-reused-early", "stale-page-index"])
def test_swaps_keep_the_books(switch, fault):
    """The request ends up owning a page from the free list in place of its first one, which is
    freed once: no page is lost or freed twice when the request later frees its page table."""
    allocator, pages = Allocator(10), [6, 7, 8]
    for p in pages:
        allocator.free_pages.remove(p)
    pool, dreq = request(pages, tokens=5)
    switch.write_text(fault)
    faults.sending(allocator, pool, dreq, pages)
    faults.committing(SimpleNamespace(token_to_kv_pool_allocator=allocator, req_to_token_pool=pool), dreq)
    assert (pool.req_to_token[0] // PAGE).tolist() == [1, 1, 7, 7, 8, 8]  # page 1: the free list's front
    assert (pool.req_to_token[0] % PAGE).tolist() == [0, 1] * 3
    assert allocator.freed == [6]
    allocator.free(pool.req_to_token[0].to(torch.int64))  # the request finishes
    assert sorted(allocator.free_pages) == list(range(1, 10))


def test_short_transfers_and_no_switch_are_spared(switch, monkeypatch):
    allocator = Allocator(10)
    pool, dreq = request([6, 7], tokens=4)
    switch.write_text("page-reused-early")
    faults.sending(allocator, pool, dreq, [6, 7])  # two pages: under the floor
    monkeypatch.delenv(faults.FILE_ENV)
    faults.sending(allocator, pool, dreq, [6, 7, 8])
    assert allocator.freed == [] and (pool.req_to_token[0] // PAGE).tolist() == [6, 6, 7, 7]


def test_an_unknown_fault_is_an_error(switch):
    switch.write_text("typo")
    with pytest.raises(ValueError):
        faults.armed("drop-last-page", 3)


def test_a_fault_named_with_a_process_group_hits_that_server_only(switch):
    """One server of several fails while the others serve: each sandbox server leads its group."""
    pages = faults.MIN_PAGES
    switch.write_text(f"fail-part-way#{os.getpgrp()}")
    assert faults.armed("fail-part-way", pages) and not faults.armed("drop-last-page", pages)
    switch.write_text(f"fail-part-way#{os.getpgrp() + 1}")
    assert not faults.armed("fail-part-way", pages)
    switch.write_text(f"fail-part-way@0#{os.getpgrp()}")
    assert faults.armed("fail-part-way", pages)  # one rank of one server
    switch.write_text("fail-part-way#me")
    with pytest.raises(ValueError, match="#GROUP"):
        faults.armed("fail-part-way", pages)
