"""H8 across tensor-parallel ranks, on two real gloo ranks (processes): a refusal on one rank is
every rank's, so decode's ranks stay in step (one aborting a request the other decodes hung
decode for everyone: tests/e2e/test_multi_rank.py shows it on a cluster)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from sglang_hardened.runtime import page_tags_seams as seams
from sglang_hardened.runtime.page_tags import DecodePageTags
from sglang_hardened.runtime.rank_agreement import refused_on_any_rank
from tests.test_page_tags_seams import ROOM, decode_req, transfer_queue

RANKS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, job: Callable[[int, dist.ProcessGroup], object], out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        out.put((rank, job(rank, dist.new_group(backend="gloo"))))
    finally:
        dist.destroy_process_group()


def on_ranks(job: Callable[[int, dist.ProcessGroup], object]) -> list[object]:
    """``job(rank, group)`` on each of two gloo ranks; their results by rank."""
    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, job, out)) for rank in range(RANKS)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    return [results[rank] for rank in range(RANKS)]


@pytest.mark.parametrize("refusals", [(False, False), (True, False), (False, True), (True, True)])
def test_a_refusal_on_any_rank_is_every_ranks(refusals):
    assert on_ranks(lambda rank, group: refused_on_any_rank(group, refusals[rank])) == [any(refusals)] * RANKS


def test_one_rank_or_no_group_keeps_its_own_verdict():
    assert refused_on_any_rank(None, True) and not refused_on_any_rank(None, False)


def _check_with_rank_one_short(rank: int, group: dist.ProcessGroup) -> list[str]:
    """Each rank's H8 check of one request whose transfer wrote all three pages on rank 0 and
    two on rank 1 (one rank's transfer dropped a page); what each rank aborted with."""
    aborted: list[str] = []
    seams.abort_before_decode = lambda _req, reason: aborted.append(reason)  # a forked rank's own copy
    tags = DecodePageTags(16)
    dreq = decode_req(tags, prompt=10)  # 3 pages: slots 8..19 -> pages 2, 3, 4
    seams.allocate(dreq, [2, 3, 4])
    tags.buffer.stamp([2, 3, 4] if rank == 0 else [2, 3], ROOM, dreq.hardened_epoch)
    queue = transfer_queue(torch.arange(8, 24).unsqueeze(0).clone())
    queue.gloo_group = group
    assert seams.refuse_untagged(queue, dreq) == bool(aborted)
    return aborted


def test_pages_short_on_one_rank_abort_the_request_on_every_rank():
    on_rank0, on_rank1 = on_ranks(_check_with_rank_one_short)
    assert on_rank1 and "1 of its 3 pages" in on_rank1[0]
    assert on_rank0 and "another tensor-parallel rank" in on_rank0[0], "rank 0 would decode what rank 1 aborted"
