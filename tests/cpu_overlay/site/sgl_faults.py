"""Injected page faults (test instrumentation): decode reads a page its transfer did not write.

Applied by the overlay's edits to upstream and hardened builds alike, so the same
fault can be shown refused by H8 (hardened) and read behind a 200 by the
differential oracle (upstream). Off unless ``SANDBOX_PAGE_FAULT_FILE`` names a
file; the fault is the name that file holds when a hook runs (empty: none), so
one cluster serves several faults in turn. Each fault hits transfers of at least
``MIN_PAGES`` pages only (a cluster's one-word readiness probe is served; ``MIN_PAGES_ENV``
lowers it for large pages, where one page holds the probe and two a short prompt), and
prints one ``SANDBOX PAGE FAULT`` line to stderr per hit: the tests assert it,
so an edit that no longer applies to a base is noticed.

Every fault keeps the allocator's books: a page is freed exactly once and a
request frees exactly the pages its page table holds.

- ``drop-last-page`` (prefill, Mooncake transfer worker): each send of a chunk
  to decode leaves out the chunk's last page: its KV and, on hardened builds,
  its tag row, which travels in the same ``send_kvcache`` call (between unequal
  TP sizes, the rank's head slice of the page and its heads' tag slots, in the
  same ``send_kvcache_slice``). Decode reads whatever that page held before.
- ``stale-page-index`` (decode, at the first poll that finds the transfer
  done, before H8's check starts and the transfer is committed): the request's first transferred page is swapped in its page
  table for a page taken from the free list, whose bytes hold whatever tenant
  used it last, and the original is freed. The request owns the stale page;
  its transfer wrote the original.
- ``page-reused-early`` (decode, as the page indices go to prefill): the same
  swap before the transfer lands. The original page is back on the free list
  while prefill's write into it is still to come, so whoever is given it next
  can have its KV overwritten by this request's, and this request reads a page
  its transfer never writes. The oracle's requests run one at a time, so the
  late write lands before the next request is admitted: what it shows is the
  request's own read of what earlier requests left (``SANDBOX_LEDGER_DIR`` would show
  the page freed between its exposure and the write).

- ``fail-part-way`` (prefill, Mooncake and NIXL transfer workers): a send writes
  the first half of the chunk's pages, then fails, as a link that drops
  mid-transfer does: Mooncake's call returns -1; NIXL's post of the half
  settles (the ledger records its end), then the post raises, into upstream's
  own failure path for a batch that broke while it was built. Not a read
  fault: the transfer fails, and the question is what each side does with the
  pages (tests/e2e/test_fault_matrix.py).
- ``aux-cut`` (prefill, Mooncake transfer worker): the transfer's metadata (first
  token, room) goes over upstream's TCP aux path (``send_aux_tcp``, which NVLink
  pools and ``SGLANG_MOONCAKE_SEND_AUX_TCP`` use) in frames whose length field
  says one byte more than they carry, as a frame cut short would; decode's
  ``_handle_aux_data`` drops each ("AUX_DATA length mismatch"), while the KV and
  prefill's Success arrive. Not a read fault: decode's metadata gate holds the
  request for its row (tests/e2e/test_fault_matrix.py, H13).
- ``post-rejected`` (prefill, NIXL transfer worker): NIXL rejects a send's
  post after it put the chunk's first half on the wire. Stand-in for what
  NIXL does below its API: that half is posted from another thread
  ``LATE_S`` later, tracked by no handle of the worker's, and the agent's
  ``transfer`` answers ERR for the post the worker makes, so each build
  raises what it raises for a rejected post. Not a read fault either.

A fault file's name may end in ``@RANK`` (``drop-last-page@1``): then it hits that tensor-parallel
rank's transfers only (the process's ``torch.distributed`` rank; one-rank servers are rank 0), as a
fault on one GPU or one NIC of a multi-rank server would; and in ``#GROUP``
(``fail-part-way#4242``): then it hits the server whose process group that is only (every sandbox
server leads a group of its own, its ranks in it), one server of several failing while the others serve.

H8 refuses each read fault: the page read does not carry the request's (room, epoch).
A dropped page's row was reset when decode allocated it and no row came; a
swapped-in page's row was reset when its last owner released it (or holds an
older epoch's late write), and this request's transfer never writes it.
"""

from __future__ import annotations

import os
import sys
import threading
import time


FILE_ENV = "SANDBOX_PAGE_FAULT_FILE"
FAULTS = ("drop-last-page", "stale-page-index", "page-reused-early", "fail-part-way", "post-rejected", "aux-cut")
MIN_PAGES_ENV = "SANDBOX_PAGE_FAULT_MIN_PAGES"
MIN_PAGES = int(os.environ.get(MIN_PAGES_ENV, "16"))
SETTLE_S = 30.0  # how long a NIXL fault waits for the half write it posted to settle
LATE_S = 3.0  # how late post-rejected's half lands: under the release timeout, well after an ack at once


def _rank() -> int:
    import torch.distributed as dist  # here: the sandbox's tool reads this module's names without torch

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def armed(fault: str, pages: int) -> bool:
    """Whether ``fault`` hits a transfer of ``pages`` pages now, in this rank."""
    path = os.environ.get(FILE_ENV)
    if not path or pages < MIN_PAGES:
        return False
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return False
    named, _, group = text.partition("#")
    name, _, rank = named.partition("@")
    if name and name not in FAULTS or rank and not rank.isdigit() or group and not group.isdigit():
        raise ValueError(f"{path}: {text!r} is not one of {FAULTS}, optionally @RANK and #GROUP")
    return name == fault and (not rank or int(rank) == _rank()) and (not group or int(group) == os.getpgrp())


def _hit(fault: str, room, what: str) -> None:
    print(f"SANDBOX PAGE FAULT {fault}: room {int(room)}: {what} (rank {_rank()})", file=sys.stderr, flush=True)


def dropping_last_page(req, send):
    """Prefill's Mooncake transfer worker: ``send_kvcache`` (or ``send_kvcache_slice``) without each
    chunk's last page."""
    def call(session_id, prefill_pages, dst_ptrs, dst_pages, *args, **kwargs):
        if armed("drop-last-page", len(dst_pages)):
            _hit("drop-last-page", req.room, f"decode page {int(dst_pages[-1])} left unwritten")
            prefill_pages, dst_pages = prefill_pages[:-1], dst_pages[:-1]
        return send(session_id, prefill_pages, dst_ptrs, dst_pages, *args, **kwargs)
    return call


def failing_part_way(req, send):
    """Prefill's Mooncake transfer worker: ``send_kvcache`` that writes half the chunk, then fails."""
    def call(session_id, prefill_pages, dst_ptrs, dst_pages, *args, **kwargs):
        if not armed("fail-part-way", len(dst_pages)):
            return send(session_id, prefill_pages, dst_ptrs, dst_pages, *args, **kwargs)
        half = len(dst_pages) // 2
        _hit("fail-part-way", req.room, f"{half} of {len(dst_pages)} pages written, then the call fails")
        send(session_id, prefill_pages[:half], dst_ptrs, dst_pages[:half], *args, **kwargs)
        return -1
    return call


class _Cut(bytes):
    """A frame's payload whose ``len``, which upstream's sender writes into the length field, is
    one more than the bytes it carries (ZeroMQ sends the bytes themselves)."""

    def __len__(self) -> int:
        return super().__len__() + 1


class _CuttingFrames:
    """``manager`` as upstream's ``send_aux_tcp`` sees it, but every frame it sends is cut."""

    def __init__(self, manager):
        self._manager = manager

    def __getattr__(self, name: str):
        return getattr(self._manager, name)

    def send_aux_data_to_endpoint(self, *, data: bytes, **frame) -> None:
        type(self._manager).send_aux_data_to_endpoint(self._manager, data=_Cut(data), **frame)


def cutting_aux(req, manager):
    """Prefill's Mooncake transfer worker: ``send_aux``, or, under ``aux-cut``, upstream's TCP aux
    path with every frame cut (the call still reports success, as upstream's does)."""
    if not armed("aux-cut", len(req.dst_kv_indices)):
        return manager.send_aux
    _hit("aux-cut", req.room, "metadata frames sent over TCP one byte short of their length field")
    return lambda *args: type(manager).send_aux_tcp(_CuttingFrames(manager), *args)


def _settle(req, agent, handle) -> str:
    """Wait, at most ``SETTLE_S``, for a write a fault posted to settle; its last state. The ledger
    gets the write's end only if it settled (else it may still land)."""
    deadline = time.monotonic() + SETTLE_S
    while (state := agent.check_xfer_state(handle)) not in ("DONE", "ERR") and time.monotonic() < deadline:
        time.sleep(0.001)
    if state in ("DONE", "ERR"):
        __import__("sgl_ledger").landed(req.room)
    return state


def failing_part_way_nixl(req, post):
    """Prefill's NIXL transfer worker: ``send_kvcache`` that posts half the chunk, waits for that
    write to settle, then raises."""
    def call(peer, src_pages, dst_ptrs, dst_pages, *args, **kwargs):
        if not armed("fail-part-way", len(dst_pages)):
            return post(peer, src_pages, dst_ptrs, dst_pages, *args, **kwargs)
        half = len(dst_pages) // 2
        handle = post(peer, src_pages[:half], dst_ptrs, dst_pages[:half], *args, **kwargs)
        state = _settle(req, post.__self__.agent, handle)
        _hit("fail-part-way", req.room, f"{half} of {len(dst_pages)} pages written ({state}), then the post fails")
        raise RuntimeError(f"SANDBOX PAGE FAULT fail-part-way: room {int(req.room)}: the link dropped mid-transfer")
    return call


def rejecting_post_nixl(req, manager, send):
    """Prefill's NIXL transfer worker: ``send_kvcache`` whose post NIXL rejects after it put the
    chunk's first half on the wire (that half lands ``LATE_S`` later)."""
    def call(peer, src_pages, dst_ptrs, dst_pages, *args, **kwargs):
        if not armed("post-rejected", len(dst_pages)):
            return send(peer, src_pages, dst_ptrs, dst_pages, *args, **kwargs)
        half = len(dst_pages) // 2

        def land_late() -> None:
            time.sleep(LATE_S)
            _settle(req, manager.agent, send(peer, src_pages[:half], dst_ptrs, dst_pages[:half], *args, **kwargs))

        threading.Thread(target=land_late, name="sandbox-late-half", daemon=True).start()
        _hit("post-rejected", req.room, f"post rejected; {half} of {len(dst_pages)} pages land {LATE_S:.0f} s later")
        agent = manager.agent
        agent.transfer = lambda *_, **__: "ERR"  # the worker's own post is the one rejected
        try:
            return send(peer, src_pages[half:], dst_ptrs, dst_pages[half:], *args, **kwargs)
        finally:
            del agent.transfer
    return call


def _swap_page(allocator, req_to_token_pool, req, page: int) -> int | None:
    """Give ``req`` a page from the free list in place of its ``page`` and free ``page``;
    the new page, or None when the free list has none."""
    import torch  # here, not at the top: the sandbox's tool reads this module's names without torch

    size = allocator.page_size
    row = req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(req.origin_input_ids)]
    at = (row // size == page).nonzero().flatten()
    fresh = allocator.alloc(size)
    if fresh is None or len(at) == 0:
        return None
    row[at] = fresh[row[at] % size].to(row.dtype)
    allocator.free(page * size + torch.arange(size, dtype=torch.int64, device=row.device))
    return int(fresh[0]) // size


def sending(allocator, req_to_token_pool, decode_req, page_indices) -> None:
    """Decode, right before it sends prefill the request's page indices."""
    if armed("page-reused-early", len(page_indices)):
        first = int(page_indices[0])
        fresh = _swap_page(allocator, req_to_token_pool, decode_req.req, first)
        _hit("page-reused-early", decode_req.req.bootstrap_room,
             f"page {first} freed before its write, request reads page {fresh}")
    elif armed("stale-page-index", len(page_indices)):
        decode_req.sandbox_stale_page = int(page_indices[0])


def committing(scheduler, decode_req) -> None:
    """Decode, at the first poll that finds the request's transfer done: before H8's check
    starts there (hardened) and upstream commits the transfer (both builds)."""
    page = getattr(decode_req, "sandbox_stale_page", None)
    if page is not None:
        decode_req.sandbox_stale_page = None
        stale = _swap_page(scheduler.token_to_kv_pool_allocator, scheduler.req_to_token_pool, decode_req.req, page)
        _hit("stale-page-index", decode_req.req.bootstrap_room, f"page {page} replaced by stale page {stale}")
