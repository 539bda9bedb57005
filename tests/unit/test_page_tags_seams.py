"""H8 seams against stand-ins for SGLang's objects: the frames round-trip, an unhardened
peer is refused, the tag layer is added only to the KV pool's transfer, the stamp and the
check read the page table."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_hardened.runtime.page_tags import seams
from sglang_hardened.runtime.page_tags.rows import DecodePageTags, SourceTags

PAGE = 4
ROOM = 7


@dataclass
class Chunk:  # TransferKVChunk's field the seam reads
    prefill_kv_indices: torch.Tensor


def decode_req(tags: DecodePageTags | None, prompt: int, pool_idx: int = 0):
    req = SimpleNamespace(bootstrap_room=ROOM, bootstrap_host="10.0.0.1",
                          origin_input_ids=list(range(prompt)), kv=SimpleNamespace(req_pool_idx=pool_idx))
    return SimpleNamespace(req=req, kv_receiver=SimpleNamespace(kv_mgr=SimpleNamespace(hardened_tags=tags)))


def transfer_queue(req_to_token: torch.Tensor):
    pool = SimpleNamespace(req_to_token=req_to_token)
    return SimpleNamespace(scheduler=SimpleNamespace(page_size=PAGE, req_to_token_pool=pool))


def commit(queue, dreq) -> bool:
    """What decode's loop runs for a transferred request, the check's two seams in a row (its
    verdict ready at once: numpy, or torch on CPU); whether it was refused."""
    assert not seams.verdict_pending(queue, dreq)
    return seams.refuse_untagged(dreq)


@pytest.fixture
def aborted(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(seams, "abort_before_decode", lambda _req, reason: seen.append(reason))
    return seen


def test_frames_round_trip_and_upstream_parses_the_rest():
    manager = SimpleNamespace(hardened_tags=DecodePageTags(8, heads=2))
    manager.hardened_tags.expected[ROOM] = 3
    msg = [b"a", b"b"] + seams.epoch_frame(manager, ROOM)
    info = seams.carried(lambda rest: SimpleNamespace(frames=rest), msg)
    assert info.frames == [b"a", b"b"] and info.hardened_h8 == 3
    rows = seams.carried(lambda rest: SimpleNamespace(frames=rest), [b"a"] + seams.tags_frame(manager))
    assert rows.frames == [b"a"]
    assert (rows.hardened_h8, rows.hardened_h8_row) == (manager.hardened_tags.buffer.rows.data_ptr(), 32)


def test_a_malformed_frame_is_dropped_and_named(caplog):
    for frame in (seams.FRAME_MAGIC + b"\x01\x02", seams.ROWS_MAGIC + struct.pack("<q", 5)):
        info = seams.carried(lambda rest: SimpleNamespace(frames=rest), [b"a", frame])
        assert info.frames == [b"a"] and info.hardened_h8 is None
    assert caplog.text.count("malformed") == 2


def test_unhardened_peers_send_and_get_no_frame():
    assert seams.carried(lambda rest: SimpleNamespace(), [b"a"]).hardened_h8 is None
    assert seams.tags_frame(SimpleNamespace()) == [] and seams.epoch_frame(SimpleNamespace(), ROOM) == []


def test_tag_layer_only_for_the_kv_pool_and_a_hardened_decode():
    kv_ptrs = [1, 2]
    manager = SimpleNamespace(hardened_tags=SourceTags(8, lanes=2), kv_args=SimpleNamespace(kv_data_ptrs=kv_ptrs),
                              decode_kv_args_table={"s": SimpleNamespace(hardened_h8=99),
                                                    "old": SimpleNamespace(hardened_h8=None)})
    src, _, item = manager.hardened_tags.lane().buf_info()
    assert seams.tag_layer(manager, "s", kv_ptrs) == [(src, 99, item)]
    assert seams.tag_layer(manager, "s", [1, 2]) == []  # a state buffer's transfer
    assert seams.tag_layer(manager, "old", kv_ptrs) == []


def test_rows_of_another_size_get_no_tags_and_one_error(caplog):
    """A decode from before rows had a slot per KV head sent a bare address (one-slot rows): a
    prefill with two-head rows writes nothing into it (it refuses instead), and says why once."""
    old = SimpleNamespace(hardened_h8=99)  # as `carried` leaves a bare address frame: no row size
    manager = SimpleNamespace(hardened_tags=SourceTags(8, lanes=1, heads=2), kv_args=SimpleNamespace(kv_data_ptrs=[1]),
                              decode_kv_args_table={"old": old, "new": SimpleNamespace(hardened_h8=99, hardened_h8_row=32)})
    assert seams.tag_layer(manager, "old", manager.kv_args.kv_data_ptrs) == []
    assert seams.tag_layer(manager, "old", manager.kv_args.kv_data_ptrs) == []
    assert caplog.text.count("keeps 16-byte tag rows and this prefill sends 32-byte ones") == 1
    assert seams.tag_layer(manager, "new", manager.kv_args.kv_data_ptrs)[0][1:] == (99, 32)


def test_before_send_stamps_the_chunk_and_sends_it_whole():
    tags = SourceTags(8, lanes=2)
    chunk, dst = Chunk(torch.tensor([1, 2, 3])), torch.tensor([4, 5, 6])
    assert seams.before_send(SimpleNamespace(hardened_tags=tags), chunk,
                             SimpleNamespace(room=ROOM, hardened_h8=5), dst) == (chunk, dst)
    assert tags.lane().rows[[1, 2, 3, 4]].tolist() == [[ROOM, 5], [ROOM, 5], [ROOM, 5], [-1, -1]]
    assert (tags.rows[1] == -1).all()  # another worker's lane is untouched


def test_check_reads_the_page_table_and_releases(aborted):
    tags = DecodePageTags(16)
    dreq = decode_req(tags, prompt=10)  # 3 pages: slots 8..19 -> pages 2, 3, 4
    req_to_token = torch.arange(8, 8 + 16).unsqueeze(0).clone()
    seams.allocate(dreq, [2, 3, 4])
    tags.buffer.stamp([2, 3, 4], ROOM, dreq.hardened_epoch)  # what the transfer carries
    assert not commit(transfer_queue(req_to_token), dreq) and not aborted
    assert ROOM not in tags.expected and tags.buffer.rows[2].tolist() == [-1, -1]  # released


def test_a_page_the_transfer_did_not_write_is_refused(aborted):
    tags = DecodePageTags(16)
    dreq = decode_req(tags, prompt=10)
    seams.allocate(dreq, [2, 3, 4])
    tags.buffer.stamp([2, 3], ROOM, dreq.hardened_epoch)
    assert commit(transfer_queue(torch.arange(8, 24).unsqueeze(0).clone()), dreq)
    assert "1 of its 3 pages" in aborted[0]


def test_no_allocation_means_refusal(aborted):
    assert commit(transfer_queue(torch.arange(8, 24).unsqueeze(0)), decode_req(DecodePageTags(16), 10))
    assert "no pages were given to check" in aborted[0]


def test_release_spares_a_room_allocated_again():
    tags = DecodePageTags(16)
    first, second = decode_req(tags, 4), decode_req(tags, 4)
    seams.allocate(first, [1])
    seams.allocate(second, [2])
    seams.release(first)
    assert tags.expected[ROOM] == second.hardened_epoch


def test_fail_closed_refuses_clean_requests_after_a_mismatch(aborted):
    tags = DecodePageTags(16, fail_closed=True)
    queue = transfer_queue(torch.arange(8, 24).unsqueeze(0).clone())
    bad, clean = decode_req(tags, 10), decode_req(tags, 10)
    seams.allocate(bad, [2, 3, 4])
    assert commit(queue, bad)
    seams.allocate(clean, [2, 3, 4])
    tags.buffer.stamp([2, 3, 4], ROOM, clean.hardened_epoch)
    assert commit(queue, clean) and "stopped admitting" in aborted[1]


@pytest.mark.parametrize("backend,prefill_tp,mla,named", [("nixl", 2, False, True), ("mooncake", 2, False, False),
                                                          ("nixl", 1, False, False), ("nixl", 2, True, False)])
def test_a_refusal_between_unequal_tp_sizes_over_nixl_names_them(aborted, backend, prefill_tp, mla, named):
    """NIXL's head-sliced sender (MHA between unequal TP sizes) carries no tags: the refusal says
    so, where an operator can act on it; Mooncake's slices carry their heads' tag slots, and MLA
    and equal sizes move whole pages, tagged, so their refusals are a page's, not the pair's."""
    dreq = decode_req(tags := DecodePageTags(16), 10)
    manager_class = type("KVManager", (), {"__module__": f"sglang.srt.disaggregation.{backend}.conn"})
    dreq.kv_receiver.kv_mgr = manager = manager_class()
    manager.hardened_tags, manager.attn_tp_size, manager.is_mla_backend = tags, 1, mla
    dreq.kv_receiver.prefill_info = SimpleNamespace(attn_tp_size=prefill_tp)
    seams.allocate(dreq, [2, 3, 4])
    assert commit(transfer_queue(torch.arange(8, 24).unsqueeze(0).clone()), dreq)
    assert ("prefill runs attention TP 2, this decode 1" in aborted[0]) == named, aborted


def test_a_head_slice_moves_its_heads_slots_to_the_decode_rows():
    """Mooncake's head-sliced sender: the slots of the heads a rank writes, from its lane's rows
    to the same heads' slots of decode's rows (decode's row: one slot per decode head)."""
    calls = []
    engine = SimpleNamespace(batch_transfer_sync=lambda *call: calls.append(call) or 0)
    tags = SourceTags(8, lanes=1, heads=2)
    manager = SimpleNamespace(hardened_tags=tags, engine=engine,
                              decode_kv_args_table={"s": SimpleNamespace(hardened_h8=10_000, hardened_h8_row=64)})
    executor = SimpleNamespace(submit=lambda fn, *args: SimpleNamespace(result=lambda: fn(*args)))
    futures = seams.slice_tags(manager, executor, "s", [1, 5], [3, 0], src_head=1, dst_head=2, heads=1, dst_heads=4)
    assert [f.result() for f in futures] == [0]
    base = tags.lane().buf_info()[0]
    assert calls == [("s", [base + 1 * 32 + 16, base + 5 * 32 + 16], [10_000 + 3 * 64 + 32, 10_000 + 32], [16, 16])]
    unregistered = SimpleNamespace(hardened_tags=tags, engine=engine, decode_kv_args_table={})
    assert seams.slice_tags(unregistered, executor, "s", [1], [3], 0, 0, 1, 1) == []  # an unhardened decode
    # heads past either row, or a decode whose rows are not `dst_heads` slots: nothing is written
    for bad in ((0, 3, 2, 4), (1, 0, 2, 4), (0, 0, 1, 2)):
        assert seams.slice_tags(manager, executor, "s", [1], [3], *bad) == []
    assert len(calls) == 1


def test_a_rank_has_a_tag_slot_per_kv_head():
    """Upstream's slicing arithmetic: a rank holds its share of the heads, at least one (fewer
    heads than ranks: each rank holds one, replicated); MLA's one latent head is every rank's."""
    def heads(total: int, tp: int, mla: bool = False) -> int:
        return seams.kv_heads(SimpleNamespace(is_mla_backend=mla, attn_tp_size=tp,
                                              kv_args=SimpleNamespace(total_kv_head_num=total)))
    assert (heads(8, 2), heads(8, 1), heads(2, 4), heads(8, 2, mla=True)) == (4, 8, 1, 1)
