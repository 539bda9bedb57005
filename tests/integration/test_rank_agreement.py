"""Decisions that must be one across tensor-parallel ranks, on two real gloo ranks (processes):
H3's and H8's refusals on decode, H5's hold of a failed request's source pages on prefill. Each rank
decided alone before, and a rank that aborted or held what the other did not hung the server
for everyone (tests/e2e/test_multi_rank.py shows both on clusters)."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from itertools import chain, repeat
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sglang_hardened.runtime import coverage
from sglang_hardened.runtime.page_tags import seams
from sglang_hardened.runtime import source_hold
from sglang_hardened.runtime.page_tags.rows import DecodePageTags
from sglang_hardened.runtime.rank_agreement import any_rank
from tests.unit.test_page_tags_seams import ROOM, decode_req, transfer_queue
from tests.unit.test_source_hold import Sender

RANKS = 2


def _rank(rank: int, init_method: str, job: Callable[[int, dist.ProcessGroup], object], out) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=RANKS)
    try:
        out.put((rank, job(rank, dist.new_group(backend="gloo"))))
    finally:
        dist.destroy_process_group()


def on_ranks(job: Callable[[int, dist.ProcessGroup], object]) -> list[object]:
    """``job(rank, group)`` on each of two gloo ranks; their results by rank. They meet through a
    file, not a TCP port picked free in advance, which another process could take first (gloo's
    own connections bind ports of the kernel's choosing)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as rendezvous:
        init_method = f"file://{rendezvous}/store"
        procs = [ctx.Process(target=_rank, args=(rank, init_method, job, out)) for rank in range(RANKS)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(30)
    return [results[rank] for rank in range(RANKS)]


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_a_flag_on_any_rank_is_every_ranks(flags):
    got = on_ranks(lambda rank, group: any_rank([flags[rank], not flags[rank]], (None, group)))
    assert got == [[any(flags), not all(flags)]] * RANKS


def test_one_rank_or_no_group_keeps_its_own_verdict():
    assert any_rank([True, False], (None,)) == [True, False] and any_rank([], ()) == []


def _check_with_rank_one_short(rank: int, group: dist.ProcessGroup, late: bool = False) -> tuple[list[str], int]:
    """Each rank's H8 check of one request whose transfer wrote all three pages on rank 0 and
    two on rank 1 (one rank's transfer dropped a page): what each rank aborted with, and how many
    polls it skipped the request. With ``late``, rank 1 runs the torch path with its count not
    yet on the host at the first poll (its event a stand-in, done from its second query: on CPU
    torch's is done when recorded)."""
    aborted: list[str] = []
    seams.abort_before_decode = lambda _req, reason: aborted.append(reason)  # a forked rank's own copy
    tags = DecodePageTags(16, path="torch" if late else None)
    if late and rank == 1:
        queries = chain((False,), repeat(True))
        tags.event = lambda: SimpleNamespace(record=lambda: None, query=lambda: next(queries))
    dreq = decode_req(tags, prompt=10)  # 3 pages: slots 8..19 -> pages 2, 3, 4
    seams.allocate(dreq, [2, 3, 4])
    tags.buffer.stamp([2, 3, 4] if rank == 0 else [2, 3], ROOM, dreq.hardened_epoch)
    queue = transfer_queue(torch.arange(8, 24).unsqueeze(0).clone())
    queue.gloo_group = group
    skipped = 0
    while seams.verdict_pending(queue, dreq):
        skipped += 1
    assert seams.refuse_untagged(dreq) == bool(aborted)
    return aborted, skipped


@pytest.mark.parametrize("late", [False, True])
def test_pages_short_on_one_rank_abort_the_request_on_every_rank(late):
    """And with one rank's verdict later than the other's, both wait for it: neither commits nor
    aborts alone."""
    (on_rank0, skipped0), (on_rank1, skipped1) = on_ranks(lambda rank, group: _check_with_rank_one_short(rank, group, late))
    assert on_rank1 and "1 of its 3 pages" in on_rank1[0]
    assert on_rank0 and "another tensor-parallel rank" in on_rank0[0], "rank 0 would decode what rank 1 aborted"
    assert skipped0 == skipped1 == int(late)


def _coverage(stated: tuple[bool, bool]) -> Callable[[int, dist.ProcessGroup], list[str]]:
    """Each rank's H3 check of one request whose metadata row states its prompt on the ranks
    ``stated`` names and nothing on the others (their rows came from elsewhere); what each rank
    aborted with."""
    def job(rank: int, group: dist.ProcessGroup) -> list[str]:
        aborted: list[str] = []
        coverage.abort_before_decode = lambda _req, reason: aborted.append(reason)  # a forked rank's own copy
        dreq = decode_req(None, prompt=10)
        dreq.req.rid = "r1"
        row = [ROOM, 0, 0]
        if stated[rank]:
            coverage.stamp(row, dreq.req)
        assert coverage.refuse_uncovered(SimpleNamespace(gloo_group=group), dreq, row) == bool(aborted)
        return aborted
    return job


def test_a_prompt_one_rank_s_transfer_did_not_cover_is_aborted_on_every_rank():
    """Before, rank 0 went on to decode (and into H8's agreement, which rank 1, returning here,
    never reached: the server's next collectives paired wrongly)."""
    on_rank0, on_rank1 = on_ranks(_coverage((True, False)))
    assert on_rank1 and "did not state how many prompt tokens" in on_rank1[0]
    assert on_rank0 and "another tensor-parallel rank" in on_rank0[0], "rank 0 would decode what rank 1 aborted"


def test_ranks_that_refuse_alike_each_name_their_own_cause_and_covered_ones_all_go_on():
    assert all(len(a) == 1 and "did not state how many prompt tokens" in a[0] for a in on_ranks(_coverage((False, False))))
    assert on_ranks(_coverage((True, True))) == [[], []]


def _source_hold_with_rank_zero_sending(rank: int, group: dist.ProcessGroup) -> list[bool]:
    """A failed request whose chunk rank 0's worker still sends (rank 1's is done), and an
    aborted one parked the same way; what each rank decides, in order."""
    scheduler = SimpleNamespace(attn_cp_cpu_group=None, attn_tp_cpu_group=group)
    source_hold.process_release_timeout_s = lambda: 8.0
    in_flight = 1 if rank == 0 else 0
    failed_kept = source_hold.still_sending(Sender(1, in_flight), scheduler)
    released: list[str] = []
    source_hold.release_when_sent("aborted", Sender(2, in_flight), lambda: released.append("aborted"), scheduler)
    source_hold.release_parked(scheduler)
    return [failed_kept, not released]


def test_a_failed_request_is_held_on_every_rank_while_any_rank_still_sends_it():
    assert on_ranks(_source_hold_with_rank_zero_sending) == [[True, True]] * RANKS, \
        "rank 1 released what rank 0 held: their queues and free pools diverge"
