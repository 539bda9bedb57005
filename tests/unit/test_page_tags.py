"""H8 page tags: the bookkeeping against a pure-Python reference, in random interleavings.

The harness plays decode's allocator and page tables, prefill, and the
transfer engine (a tag row moves from prefill page to decode page as every KV
layer's item does); the tag logic under test is the real module. Two oracles:
a reference model of the rule ("allowed exactly when every page's last write
since it was last allocated or released carries the reader's current room and
epoch"; a room's allocation ends when it is released or when one of its pages
is allocated again), and the ground truth of who wrote each page's data, which an allowed
read must never contradict. Every behavioural test runs on both row paths
(torch, which CUDA runs; numpy, which CPU runs), on CPU tensors.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_hardened.common.knobs import PAGE_TAGS_COST_EVERY, PAGE_TAGS_FAIL_CLOSED
from sglang_hardened.runtime.page_tags.rows import (ROW_PATHS, DecodePageTags, PageTagMismatch,
                                               SourceTags, TagBuffer)
from sglang_hardened.runtime.page_tags.cost import CostMeter, read_cost_lines
from sglang_hardened.runtime.policy import load_limits
from tests.harness import REPO

DECODE_PAGES = 12
PREFILL_PAGES = 6
Tag = tuple[int, int]
both_paths = pytest.mark.parametrize("path", tuple(ROW_PATHS))


def transfer(prefill: TagBuffer, decode: DecodePageTags, src: list[int], dst: list[int]) -> None:
    """What the engine does with the tag 'layer': copy row src[i] to row dst[i]."""
    decode.buffer.rows.index_copy_(0, torch.tensor(dst), prefill.rows[torch.tensor(src)])


@dataclass
class Req:
    room: int
    epoch: int
    table: list[int]  # decode's page table for the request (what the check reads)
    src: list[int]  # prefill pages holding its KV


@dataclass
class Harness:
    path: str
    decode: DecodePageTags = field(init=False)
    prefill: TagBuffer = field(init=False)
    free: list[int] = field(default_factory=lambda: list(range(DECODE_PAGES)))
    live: dict[int, Req] = field(default_factory=dict)
    gone: list[Req] = field(default_factory=list)  # released; their transfers may still land
    retracted: list[int] = field(default_factory=list)  # rooms that will be allocated again
    next_room: int = 0
    epochs_seen: set[int] = field(default_factory=set)
    # The reference model of the rule, and the ground truth of each page's data.
    ref_tag: dict[int, Tag | None] = field(default_factory=dict)
    ref_expected: dict[int, int] = field(default_factory=dict)
    ref_allocated: dict[int, list[int]] = field(default_factory=dict)
    written_by: dict[int, Tag | None] = field(default_factory=dict)
    failed_checks: int = 0

    def __post_init__(self) -> None:
        self.decode = DecodePageTags(DECODE_PAGES, fail_closed=False, path=self.path)
        self.prefill = TagBuffer(PREFILL_PAGES, path=self.path)

    def allocate(self, room: int, size: int, src_seed: int) -> None:
        if len(self.free) < size:
            return
        pages, self.free = self.free[:size], self.free[size:]
        epoch = self.decode.allocate(room, pages)
        assert epoch >= 1 and epoch not in self.epochs_seen
        self.epochs_seen.add(epoch)
        owners = {r for r, held in self.ref_allocated.items() if set(held) & set(pages)}
        for stale in owners | {room}:  # pages handed out again end their holder's allocation
            self.ref_forget(stale)
        self.ref_expected[room] = epoch
        self.ref_allocated[room] = list(pages)
        self.ref_tag.update(dict.fromkeys(pages))
        src = [(src_seed + i * 5) % PREFILL_PAGES for i in range(size)]
        self.live[room] = Req(room, epoch, pages, src)

    def new_request(self, size: int, src_seed: int) -> None:
        # Rooms are random 63-bit in SGLang; spread them to exercise the full int64 range.
        room = (self.next_room * 0x9E3779B97F4A7C15) % (2**63)
        self.next_room += 1
        self.allocate(room, size, src_seed)

    def resume_retracted(self, size: int, src_seed: int) -> None:
        if self.retracted:
            self.allocate(self.retracted.pop(0), size, src_seed)

    def send(self, req: Req, keep: int) -> None:
        """Prefill stamps and sends; bit i of `keep` clear drops page i (a lost chunk)."""
        self.prefill.stamp(req.src, req.room, req.epoch)
        pairs = [(s, d) for i, (s, d) in enumerate(zip(req.src, req.table)) if keep >> i & 1]
        if pairs:
            src, dst = map(list, zip(*pairs))
            transfer(self.prefill, self.decode, src, dst)
            for d in dst:
                self.ref_tag[d] = self.written_by[d] = (req.room, req.epoch)

    def release(self, req: Req, retract: bool) -> None:
        del self.live[req.room]
        self.decode.release(req.room)  # the pages it was given, whatever its table says now
        self.ref_forget(req.room)
        self.free.extend(req.table)
        self.gone.append(req)
        if retract:
            self.retracted.append(req.room)

    def ref_forget(self, room: int) -> None:
        self.ref_expected.pop(room, None)
        self.ref_tag.update(dict.fromkeys(self.ref_allocated.pop(room, ())))

    def check(self, req: Req) -> None:
        verdict = self.decode.check(req.room, req.table)
        expected = self.ref_expected.get(req.room)
        allowed = expected is not None and all(self.ref_tag.get(p) == (req.room, expected) for p in req.table)
        assert (verdict is None) == allowed, (verdict, req, self.ref_tag)
        if allowed:  # never another request's data, nor an earlier allocation's
            assert all(self.written_by.get(p) == (req.room, expected) for p in req.table)
        else:
            self.failed_checks += 1
            assert f"room={req.room}" in verdict
        assert self.decode.mismatched_requests == self.failed_checks


# Faults are rarer than the normal path, so that requests live long enough to be read.
OPS = ("new",) * 4 + ("send",) * 4 + ("check",) * 3 + (
    "resume", "check_gone", "finish", "abort", "retract", "late_write", "stale_index", "reuse_early")


@both_paths
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**16), st.integers(0, 2**16)),
                min_size=4, max_size=60))
def test_a_read_is_allowed_exactly_when_every_page_carries_the_readers_current_tag(path, ops):
    h = Harness(path)
    for op, a, b in ops:
        live = list(h.live.values())
        req = live[a % len(live)] if live else None
        if op == "new":
            h.new_request(1 + b % 4, a)
        elif op == "resume":
            h.resume_retracted(1 + b % 4, a)
        elif op == "check_gone" and h.gone:
            gone = h.gone[a % len(h.gone)]
            if gone.room not in h.live:  # a released room reads nothing, whatever its pages hold
                h.check(gone)
        elif op == "late_write" and h.gone:
            h.send(h.gone[a % len(h.gone)], b)  # an aborted transfer landing after release
        elif req is None:
            continue
        elif op == "send":
            h.send(req, b if a % 2 else -1)  # half of them complete, half drop random pages
        elif op == "check":
            h.check(req)
        elif op in ("finish", "abort", "retract"):
            h.release(req, retract=op == "retract")
        elif op == "stale_index":  # a bug puts some other page into the request's page table
            req.table[b % len(req.table)] = a % DECODE_PAGES
        elif op == "reuse_early":  # a bug frees one of its pages behind the tags' back
            h.free.insert(0, req.table[b % len(req.table)])
    for req in list(h.live.values()):
        h.check(req)


@both_paths
def test_a_complete_transfer_passes_and_nothing_else_does(path):
    h = Harness(path)
    h.new_request(DECODE_PAGES, 0)  # the whole pool, so a resumed request gets the same pages
    [req] = h.live.values()
    assert h.decode.check(req.room, req.table) is not None  # allocated, not yet written
    h.send(req, keep=-1)
    assert h.decode.check(req.room, req.table) is None
    assert h.decode.check(req.room + 1, req.table) is not None  # someone else's pages
    h.release(req, retract=True)
    assert h.decode.check(req.room, req.table) is not None  # released
    h.resume_retracted(DECODE_PAGES, 0)
    [back] = h.live.values()
    assert (back.room, sorted(back.table)) == (req.room, sorted(req.table)) and back.epoch != req.epoch
    h.send(req, keep=-1)  # the retracted allocation's transfer lands late: same room, same pages
    assert h.decode.check(back.room, back.table) is not None
    h.send(back, keep=-1)
    assert h.decode.check(back.room, back.table) is None


@both_paths
def test_a_page_given_back_by_its_owner_stops_vouching_for_a_stale_reader(path):
    h = Harness(path)
    h.new_request(2, 0)
    h.new_request(2, 1)
    owner, stale = h.live.values()
    stale.table[0] = owner.table[0]  # a stale index: the reader's table points at the owner's page
    h.send(stale, keep=-1)  # its own KV lands there, with its own tag
    h.check(stale)  # allowed: every page holds its data
    h.release(owner, retract=False)  # the page goes back to the free list, to be handed out again
    h.check(stale)  # refused now (the harness asserts the verdict against the reference)
    assert h.decode.check(stale.room, stale.table) is not None


@both_paths
def test_a_released_room_is_refused_even_when_its_late_transfer_lands(path):
    h = Harness(path)
    h.new_request(2, 0)
    [req] = h.live.values()
    h.release(req, retract=False)  # aborted while its transfer was in flight
    h.send(req, keep=-1)  # the transfer lands: its own room and epoch on every page
    assert h.decode.check(req.room, req.table) is not None


@both_paths
def test_mismatch_message_names_room_and_page_count(caplog, path):
    tags = DecodePageTags(8, fail_closed=False, path=path)
    epoch = tags.allocate(42, [0, 1, 2, 3])
    tags.buffer.stamp([0, 1], 42, epoch)
    with caplog.at_level(logging.ERROR, logger="sglang_hardened"):
        message = tags.check(42, [0, 1, 2, 3])
    assert f"room=42 epoch={epoch}: 2 of its 4 pages" in message
    assert message in caplog.text
    assert (tags.mismatched_requests, tags.mismatched_pages) == (1, 2)
    assert tags.check(42, []) is not None  # nothing checked is no proof


@both_paths
def test_a_page_with_one_head_slot_unwritten_is_refused(path):
    """Between unequal TP sizes each prefill rank writes only its heads' slots of a decode page: a
    page is its request's only when every head's slot carries the tag, however many pages."""
    tags = DecodePageTags(8, fail_closed=False, path=path, heads=2)
    prefill = TagBuffer(8, path=path, heads=2)
    epoch = tags.allocate(42, [0, 1, 2])
    prefill.stamp([0, 1, 2], 42, epoch)  # every slot of its rows
    tags.buffer.rows[[0, 1, 2], :2] = prefill.rows[[0, 1, 2], :2]  # head 0's slots, from rank 0
    tags.buffer.rows[[0, 1], 2:] = prefill.rows[[0, 1], 2:]  # head 1's, from rank 1: page 2 lost
    assert f"room=42 epoch={epoch}: 1 of its 3 pages" in tags.check(42, [0, 1, 2])
    tags.buffer.rows[2, 2:] = prefill.rows[2, 2:]
    assert tags.check(42, [0, 1, 2]) is None
    assert tags.buffer.buf_info()[2] == 2 * 16  # a page's row: every head's slot


@both_paths
@pytest.mark.parametrize("page", [-1, 8])
def test_a_page_index_outside_the_pool_raises_on_either_path(path, page):
    """No path may read another page's row for an index outside the pool. Writes: numpy would
    wrap -1 round to the last page, so the CPU path refuses it; torch's `index_fill_` wraps it
    as Python does (a check on a GPU would cost a sync), which only SGLang's own allocator, never
    a client, could hand it."""
    tags = DecodePageTags(8, fail_closed=False, path=path)
    tags.buffer.stamp([7], 3, 1)
    writes = (lambda: tags.allocate(3, [page]), lambda: tags.buffer.stamp([0, page], 3, 1))
    for op in (lambda: tags.check(3, [page]), *(writes if page >= 0 or path == "numpy" else ())):
        with pytest.raises(IndexError):
            op()
    assert tags.buffer.rows[7].tolist() == [3, 1]  # the last page untouched
    assert 3 not in tags.expected  # a refused allocation leaves no expectation behind


def test_cpu_rows_take_the_numpy_path_and_a_gpu_path_cannot_be_numpy():
    assert TagBuffer(4).path == "numpy" and TagBuffer(4, path="torch").path == "torch"
    with pytest.raises(ValueError, match="cannot run on meta"):
        TagBuffer(4, device="meta", path="numpy")


@pytest.mark.parametrize("env, fail_closed", [("1", True), ("0", False), (None, False)])
def test_fail_closed_stops_admission_after_a_mismatch(monkeypatch, env, fail_closed):
    if env is None:
        monkeypatch.delenv(PAGE_TAGS_FAIL_CLOSED.name, raising=False)
    else:
        monkeypatch.setenv(PAGE_TAGS_FAIL_CLOSED.name, env)
    tags = DecodePageTags(4)
    tags.allocate(7, [0])
    tags.admit()
    assert tags.check(7, [0]) is not None
    if not fail_closed:
        tags.admit()
        return
    with pytest.raises(PageTagMismatch, match="room=7 epoch=1: 1 of its 1 pages.*Restart it"):
        tags.admit()


@both_paths
def test_buf_info_is_what_a_transfer_engine_registers(path):
    buffer = TagBuffer(10, path=path)
    ptr, nbytes, item_len = buffer.buf_info()
    assert (ptr, nbytes, item_len) == (buffer.rows.data_ptr(), 10 * 16, 16)
    buffer.stamp([3], 2**63 - 1, 9)  # the largest room SGLang draws
    # The bytes an engine copies for page 3: two native int64 words at ptr + 3 * item_len.
    assert struct.unpack("=qq", ctypes.string_at(ptr + 3 * item_len, item_len)) == (2**63 - 1, 9)


def in_another_thread(call):
    """What `call` returns, or raises, run on a thread of its own (a transfer worker)."""
    out: list = []

    def run():
        try:
            out.append(call())
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out[0]


@both_paths
def test_each_sending_thread_stamps_its_own_lane_of_one_registration(path):
    tags = SourceTags(10, lanes=2, path=path)
    ptr, nbytes, item_len = tags.buf_info()
    assert (ptr, nbytes, item_len) == (tags.rows.data_ptr(), 2 * 10 * 16, 16)
    mine = tags.lane()
    assert tags.lane() is mine and mine.path == path

    def stamp_page_3():
        tags.lane().stamp([3], 41, 2)
        return tags.lane()

    theirs = in_another_thread(stamp_page_3)
    mine.stamp([3], 2**63 - 1, 9)  # the same prefill page, another request
    assert theirs.buf_info()[0] == ptr + 10 * item_len  # the second lane's rows, registered with the first's
    assert struct.unpack("=qq", ctypes.string_at(ptr + 3 * item_len, item_len)) == (2**63 - 1, 9)
    assert struct.unpack("=qq", ctypes.string_at(ptr + (10 + 3) * item_len, item_len)) == (41, 2)


def test_a_thread_past_the_last_lane_is_refused():
    tags = SourceTags(4, lanes=1)
    tags.lane()
    assert "more threads send KV than prefill has tag lanes (1" in str(in_another_thread(tags.lane))


def test_gpu_benchmark_runs_its_code_path_on_cpu_at_small_sizes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from gpu_page_tags import measure

    result = measure(torch.device("cpu"), pool_tokens=4096, page_size=16, batch=8,
                                  pages_per_request=4, repeat=2)
    assert result.failures_caught == result.batch  # every request of the faulty batch was caught
    assert result.stamp_s > 0 and result.check_s > 0


def test_the_cost_line_gives_each_operation_per_request_every_n_requests(caplog, monkeypatch):
    monkeypatch.setenv(PAGE_TAGS_COST_EVERY.name, "2")
    tags, prefill = DecodePageTags(8, fail_closed=False), TagBuffer(8, cost=CostMeter("prefill", "stamp", "send"))
    with caplog.at_level(logging.INFO, logger="sglang_hardened"):
        for room in (1, 2, 3):
            pages = [2 * room - 2, 2 * room - 1]
            epoch = tags.allocate(room, pages)
            prefill.stamp(pages, room, epoch)
            transfer(prefill, tags, pages, pages)
            assert tags.check(room, pages) is None
            tags.release(room)
    [decode] = [line for line in read_cost_lines(caplog.text) if line.role == "decode"]  # 3 requests: one window
    [send] = [line for line in read_cost_lines(caplog.text) if line.role == "prefill"]
    assert decode.count == 2 and list(decode.wall_us) == ["allocate", "check", "release"]
    assert send.count == 2 and list(send.wall_us) == ["stamp"]
    assert decode.pages == {"allocate": 2, "check": 2, "release": 2} and send.pages == {"stamp": 2}
    for line in (decode, send):
        assert all(line.wall_us[op] > 0 and line.cpu_us[op] > 0 for op in line.pages)


@pytest.mark.parametrize("value", ["-1", "ten", ""])
def test_a_bad_cost_line_setting_stops_start_up_naming_it(monkeypatch, value):
    monkeypatch.setenv(PAGE_TAGS_COST_EVERY.name, value)
    with pytest.raises(ValueError, match=f"{PAGE_TAGS_COST_EVERY.name}={value!r}: give a whole number"):
        DecodePageTags(8)


def test_the_cost_line_is_off_unless_asked_for(caplog, monkeypatch):
    monkeypatch.delenv(PAGE_TAGS_COST_EVERY.name, raising=False)
    assert load_limits("H8")["cost_report_every"] == 0
    tags = DecodePageTags(8, fail_closed=False)
    with caplog.at_level(logging.INFO, logger="sglang_hardened"):
        tags.allocate(1, [0])
        tags.release(1)
    assert tags.cost.start() is None and not read_cost_lines(caplog.text)


def test_a_stamp_made_while_another_worker_writes_the_cost_line_is_counted(caplog, monkeypatch):
    monkeypatch.setenv(PAGE_TAGS_COST_EVERY.name, "2")
    prefill = TagBuffer(8, cost=CostMeter("prefill", "stamp", "send"))
    other_worker = threading.Thread(target=prefill.stamp, args=([5], 5, 1))  # SGLang runs one per transfer queue

    class StampWhileWriting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not other_worker.is_alive() and other_worker.ident is None:
                other_worker.start()
                other_worker.join(timeout=30)  # a worker blocked on this line's lock would hang it; a slow one passes

    handler = StampWhileWriting()
    logging.getLogger("sglang_hardened").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="sglang_hardened"):
            for room in range(3):  # the second ends the first window; the other worker stamps meanwhile
                prefill.stamp([room], room, 1)
    finally:
        logging.getLogger("sglang_hardened").removeHandler(handler)
    assert [line.count for line in read_cost_lines(caplog.text)] == [2, 2]  # its stamp opened the next window
