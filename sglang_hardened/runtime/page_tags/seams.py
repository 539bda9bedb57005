"""H8 seams: adapt SGLang's PD objects (Mooncake; NIXL's adapters are `page_tags.nixl`) to `page_tags.rows`.

Where the tags live and travel:
- Both roles' Mooncake managers make a tag buffer beside the KV pool when
  they register their buffers (`register`), and register it with the engine.
- Decode picks an epoch for the request just before it sends prefill the
  page indices (`allocate`), and sends the epoch, and once per session its
  tag buffer's address and a row's size (so prefill writes nothing into rows
  of another shape: `decode_rows`), as one extra trailing ZMQ frame
  (`epoch_frame`, `tags_frame`). A frame is tagged by a magic prefix and stripped before
  upstream parses the message (`carried`), so an unhardened prefill, which
  never reads frames past its own, just ignores it: it sends no tags and a
  hardened decode refuses every request (no stamp means failure).
- Prefill stamps its rows for the pages of a chunk right before the
  synchronous send to one destination (`before_send`), and the rows move
  as one more "layer" of the same batch (`tag_layer`), page index for page
  index, so a row reaches decode exactly when its page's KV does. Each
  transfer worker stamps and sends its own lane of rows (`SourceTags`):
  requests sharing cached prefix pages send the same prefill pages.
- A row holds a (room, epoch) slot per KV head of the rank (`kv_heads`).
  Between unequal TP sizes (MHA) upstream's sender writes each rank's head
  slice of a page on its own, and the slots of those heads go with it
  (`slice_tags`): a decode page is vouched for only when every prefill rank
  that writes part of it wrote its part.
- Decode checks the pages in the request's page table before its first
  decode step: it starts the check once the transfer succeeded and reads the
  verdict once the device has written it (`verdict_pending`), and acts on it
  where upstream commits the transfer (`refuse_untagged`); it forgets the
  epoch there or when the request is released before it (`release`). With tensor parallelism each
  rank checks its own shard, and a refusal on any rank is every rank's
  (`rank_agreement`).

The end-to-end tests inject faults that H8 must catch from the test overlay
(`tests/cpu_overlay/site/sgl_faults.py`), on upstream and hardened builds alike.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import torch

from ...common.knobs import PAGE_TAGS, PAGE_TAGS_FAIL_CLOSED
from .. import metrics
from ..rank_agreement import any_rank
from ..refusal import abort_before_decode
from ..warmup import FAKE_BOOTSTRAP_HOST
from .rows import TAG_WORDS, DecodePageTags, PageTagMismatch, SourceTags, TagBuffer
from .switch import tags_on
from .cost import CostMeter

FRAME_MAGIC = b"sglang-hardened-H8:"  # one int64: an epoch (or an address, from a decode of one-slot rows)
ROWS_MAGIC = b"sglang-hardened-H8-rows:"  # two int64s: decode's tag rows' address and a row's bytes
SLOT_BYTES = TAG_WORDS * 8  # one (room, epoch) slot: a whole row on a decode from before rows had a slot per KV head
OTHER_RANK = ("sglang-hardened H8: request room={room}: its pages on another tensor-parallel rank of this "
              "decode do not carry its tag (that rank's transfer did not write them all); every rank "
              "aborts it, so the ranks stay in step")

log = logging.getLogger("sglang_hardened")


def send_lanes() -> int:
    """Prefill's transfer worker threads: one per transfer queue, upstream's setting read where
    upstream reads it (the managers make their queues after registering their buffers)."""
    from sglang.srt.environ import envs

    return envs.SGLANG_DISAGGREGATION_QUEUE_SIZE.get()


def kv_heads(manager) -> int:
    """The rank's KV heads, one tag slot each, by the arithmetic upstream's head-sliced sender
    uses on both ends (`max(1, total KV heads // attention TP size)`: its `src_heads_per_rank`
    and `dst_heads_per_rank`), so both roles size their rows alike and every slot a slice names
    is in its row; one for MLA, whose one latent head every rank holds whole. Prefill's
    arguments carry the model's total (`total_kv_head_num`); decode's do not (only a staging
    decode's), so decode reads it from the model's config, as upstream's prefill did."""
    if manager.is_mla_backend:
        return 1
    total = getattr(manager.kv_args, "total_kv_head_num", 0)
    if not total:
        from sglang.srt.configs.model_config import ModelConfig

        total = ModelConfig.from_server_args(manager.server_args).get_total_num_kv_heads()
    return max(1, total // manager.attn_tp_size)


def make_tags(manager) -> TagBuffer | SourceTags | None:
    """Both backends' managers: one tag row per KV page (a pool's pages are a layer's bytes over
    one page's bytes; on prefill, one row per page per transfer worker), a slot per KV head of
    the rank, on the pool's device, set as `manager.hardened_tags`. None without a
    full-token KV pool (nothing to tag: such transfers are refused on decode), or with H8 switched
    off (``PAGE_TAGS.name``: a decode without tags checks nothing, a prefill without them stamps
    nothing, so a decode with tags refuses its transfers)."""
    args = manager.kv_args
    if not tags_on():
        manager.hardened_tags = None
        log.warning("sglang-hardened H8: page tags OFF on this %s (%s=off): pages decode reads are not "
                    "checked against their writer; only for measuring H8's cost",
                    manager.disaggregation_mode.value, PAGE_TAGS.name)
        return None
    if not args.kv_item_lens:
        return None
    pages, heads = args.kv_data_lens[0] // args.kv_item_lens[0], kv_heads(manager)
    device = torch.device("cuda", args.gpu_id) if torch.cuda.is_available() else torch.device("cpu")
    if manager.disaggregation_mode.value == "decode":
        manager.hardened_tags = DecodePageTags(pages, device, heads=heads)
        buffer = manager.hardened_tags.buffer
        log.info("sglang-hardened H8: decode page tags on, %d pages x %d KV heads on %s; fail closed: %s (%s)",
                 pages, heads, device, manager.hardened_tags.fail_closed, PAGE_TAGS_FAIL_CLOSED.name)
    else:
        manager.hardened_tags = buffer = SourceTags(pages, send_lanes(), device,
                                                    CostMeter("prefill", closing_op="stamp", unit="send"), heads=heads)
    return buffer


def register(manager) -> None:
    """Seam at the end of `MooncakeKVManager.register_buffer_to_engine`: make the tag buffer and
    register it with the Mooncake engine."""
    buffer = make_tags(manager)
    if buffer is not None:
        ptr, nbytes, _ = buffer.buf_info()
        manager.engine.batch_register([ptr], [nbytes])


def _frame(value: int) -> list[bytes]:
    return [FRAME_MAGIC + struct.pack("<q", value)]


def tags_frame(manager) -> list[bytes]:
    """Seam in decode's registration message: the address prefill writes tag rows to, and a
    row's size. Its own magic: a prefill from before rows had head slots does not know it, so it
    treats this decode as unhardened (sends no tags; decode refuses) rather than writing rows of
    the wrong size into it."""
    tags = getattr(manager, "hardened_tags", None)
    if not isinstance(tags, DecodePageTags):
        return []
    ptr, _, row = tags.buffer.buf_info()
    return [ROWS_MAGIC + struct.pack("<qq", ptr, row)]


def epoch_frame(manager, room: int) -> list[bytes]:
    """Seam in decode's metadata message: the epoch prefill stamps the room's pages with."""
    tags = getattr(manager, "hardened_tags", None)
    epoch = tags.expected.get(room) if isinstance(tags, DecodePageTags) else None
    return [] if epoch is None else _frame(epoch)


def carried(from_zmq, msg: list[bytes]):
    """Seam on prefill around `KVArgsRegisterInfo.from_zmq` / `TransferInfo.from_zmq`: strip
    decode's H8 frame before upstream parses the message; keep its value as `.hardened_h8` (the
    epoch, or decode's rows' address) and a row's size as `.hardened_h8_row`. A frame of the
    wrong length is dropped and logged: that peer gets no tags, and a hardened decode refuses."""
    values: tuple[int, ...] = ()
    for magic, layout in ((ROWS_MAGIC, "<qq"), (FRAME_MAGIC, "<q")):
        if msg and msg[-1].startswith(magic):
            try:
                values = struct.unpack(layout, msg[-1][len(magic):])
            except struct.error:
                log.error("sglang-hardened H8: a peer sent a malformed %r frame (%d bytes); its "
                          "transfers carry no page tags", magic, len(msg[-1]))
            msg = msg[:-1]
            break
    info = from_zmq(msg)
    info.hardened_h8 = values[0] if values else None
    info.hardened_h8_row = values[1] if len(values) > 1 else None
    return info


def decode_rows(manager, peer: str, row: int) -> int | None:
    """The address of `peer`'s tag rows when they are `row` bytes each (what the sender is about
    to write); None when it sent none, or rows of another size: a decode from before rows had a
    slot per KV head sent a bare address, of one-slot rows. Either way it gets no tags and
    refuses, which beats writing rows into it at the wrong offsets."""
    info = manager.decode_kv_args_table.get(peer)
    ptr = getattr(info, "hardened_h8", None)
    theirs = getattr(info, "hardened_h8_row", None) or SLOT_BYTES
    if ptr is None or theirs == row:
        return ptr
    if not getattr(info, "hardened_h8_warned", False):
        info.hardened_h8_warned = True
        log.error("sglang-hardened H8: decode %s keeps %d-byte tag rows and this prefill sends %d-byte ones "
                  "(hardened revisions from before and after tag slots per KV head); its transfers carry no "
                  "page tags and it refuses them: run one revision on both roles", peer, theirs, row)
    return None


def _decode_tags(decode_req) -> DecodePageTags | None:
    """The request's decode tags; None for warm-up (fake) receivers and backends without H8."""
    tags = getattr(getattr(decode_req.kv_receiver, "kv_mgr", None), "hardened_tags", None)
    return tags if isinstance(tags, DecodePageTags) else None


def allocate(decode_req, page_indices) -> None:
    """Seam in decode right before `kv_receiver.send_metadata(page_indices, ...)`: the pages are
    this request's from now on; a new epoch makes whatever they held vouch for nobody."""
    tags = _decode_tags(decode_req)
    if tags is not None:
        decode_req.hardened_epoch = tags.allocate(decode_req.req.bootstrap_room, page_indices)
        decode_req.hardened_pages = page_indices


def before_send(manager, kv_chunk, req, dst_indices):
    """Seam in the Mooncake transfer worker right before `send_kvcache` to one destination:
    stamp the pages about to be sent with that destination's (room, epoch). Returns the chunk
    and destination indices to send, as given (the patches assign them back)."""
    tags, epoch = getattr(manager, "hardened_tags", None), getattr(req, "hardened_h8", None)
    if tags is not None and epoch is not None:  # an info not built by `carried` is not stamped
        tags.lane().stamp(kv_chunk.prefill_kv_indices, req.room, epoch)
        if tags.device.type == "cuda":  # the engine reads the rows without joining torch's stream
            torch.cuda.current_stream(tags.device).synchronize()
    return kv_chunk, dst_indices


def tag_layer(manager, session_id: str, src_data_ptrs) -> list[tuple[int, int, int]]:
    """Seam in `_send_kvcache_generic` after the layer list is built: the calling worker's tag
    rows as one more (src, dst, item_len) layer when this is the KV pool's transfer and both ends
    have tags."""
    tags = getattr(manager, "hardened_tags", None)
    if tags is None or src_data_ptrs is not manager.kv_args.kv_data_ptrs:
        return []
    src_ptr, _, item_len = tags.lane().buf_info()
    dst_ptr = decode_rows(manager, session_id, item_len)
    return [] if dst_ptr is None else [(src_ptr, dst_ptr, item_len)]


def slice_tags(manager, executor, session_id: str, src_pages, dst_pages, src_head: int, dst_head: int,
               heads: int, dst_heads: int) -> list:
    """Seam in Mooncake's `send_kvcache_slice` (MHA between unequal TP sizes), beside the engine
    calls of this rank's head slice: the calling worker's tag slots of the slice's heads, from the
    prefill pages' rows to the same heads' slots of the decode pages' rows, as one more engine
    call the send waits for (its futures join upstream's). Arguments are upstream's: head offsets
    and counts in heads, `dst_heads` the decode rank's heads (its row's slots, which decode's
    registration must agree with: no slot is written outside a row)."""
    tags = getattr(manager, "hardened_tags", None)
    if tags is None or not len(src_pages):
        return []
    src_ptr, _, src_row = tags.lane().buf_info()
    dst_row = dst_heads * SLOT_BYTES
    dst_ptr = decode_rows(manager, session_id, dst_row)
    if dst_ptr is None or dst_head + heads > dst_heads or (src_head + heads) * SLOT_BYTES > src_row:
        return []
    srcs = src_ptr + np.asarray(src_pages, dtype=np.int64) * src_row + src_head * SLOT_BYTES
    dsts = dst_ptr + np.asarray(dst_pages, dtype=np.int64) * dst_row + dst_head * SLOT_BYTES
    return [executor.submit(manager.engine.batch_transfer_sync, session_id, srcs.tolist(), dsts.tolist(),
                            [heads * SLOT_BYTES] * len(srcs))]


def _page_table(transfer_queue, req, pages: int, page_size: int) -> torch.Tensor:
    """Token slots of the request's last `pages` prompt pages (the transferred ones) in its page table."""
    length = len(req.origin_input_ids)
    start = (-(-length // page_size) - pages) * page_size
    return transfer_queue.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:length]


def verdict_pending(transfer_queue, decode_req, rids_to_check=None) -> bool:
    """Seam in decode's `pop_transferred`, right before `_commit_transfer_to_req` of a request
    whose transfer succeeded: start H8's check on the first such poll (on a GPU: a gather and a
    compare queued on the pool's device, the count copied to pinned memory behind an event), and
    True (the caller skips the request this time; it stays in the transfer queue, its poll still
    a success) until the count is on the host on every rank, so the loop never waits for the
    device here; upstream skips a request whose HiCache restore is pending the same way. Then
    every rank's verdict is shared (each checks its own shard of the pages: all abort, or none,
    else decode's ranks diverge), for `refuse_untagged` to act on. With pipeline parallelism
    (`rids_to_check`: the stages agreed which requests leave this poll) it waits for the count,
    as before: a stage that skipped what the others commit would diverge from them."""
    req = decode_req.req
    tags = _decode_tags(decode_req)
    if req.bootstrap_host == FAKE_BOOTSTRAP_HOST or tags is None:
        return False
    count = getattr(decode_req, "hardened_count", None)
    if count is None:
        page_size = transfer_queue.scheduler.page_size
        slots = _page_table(transfer_queue, req, len(getattr(decode_req, "hardened_pages", ())), page_size)
        # A page's index is its first slot over the page size; one-token pages are their slots.
        pages = slots if page_size == 1 else slots[::page_size] // page_size
        count = decode_req.hardened_count = tags.start_check(req.bootstrap_room, pages)
    ready = rids_to_check is not None or count.ready()
    refused_here = ready and (tags.closed_reason is not None or tags.fails(count))
    # one collective per pending request per poll, on every rank, refusing or not (never behind a short-circuit)
    waiting, refused = any_rank([not ready, refused_here], (getattr(transfer_queue, "gloo_group", None),))
    decode_req.hardened_other_rank = refused and not refused_here
    return waiting


def refuse_untagged(decode_req) -> bool:
    """Seam in decode's `_commit_transfer_to_req`, next to H3's: refuse the request (True: the
    caller returns) unless every page it is about to read carries its (room, epoch) on every
    rank: the verdict `verdict_pending` started and shared, read from host memory. A request
    that reached here without one (a path past `pop_transferred`'s seam) is checked here,
    waiting for the device, over the pages it was given: a missing check refuses rather than
    raises in decode's loop. No ranks agree on that verdict (a collective that only some ranks
    reach would hang them)."""
    req = decode_req.req
    tags = _decode_tags(decode_req)
    if req.bootstrap_host == FAKE_BOOTSTRAP_HOST or tags is None:
        return False
    count = getattr(decode_req, "hardened_count", None)
    try:
        tags.admit()
        if count is None:
            reason = tags.check(req.bootstrap_room, getattr(decode_req, "hardened_pages", ()))
        else:
            reason = tags.verdict(req.bootstrap_room, count)
    except PageTagMismatch as closed:
        reason = str(closed)
    release(decode_req)
    if reason is None and getattr(decode_req, "hardened_other_rank", False):
        reason = OTHER_RANK.format(room=req.bootstrap_room)
        log.error(reason)
        metrics.refused("H8", "decode", "another_rank")
    if reason is None:
        return False
    abort_before_decode(decode_req, f"{reason}{_unequal_tp(decode_req)} (refused so far: {tags.mismatched_requests})")
    return True


UNEQUAL_TP = ("; prefill runs attention TP {prefill}, this decode {decode}: NIXL moves KV between unequal TP "
              "sizes by head slices, which carry no page tags, so H8 refuses every such transfer (run both roles "
              "at one TP size, or Mooncake)")


def _unequal_tp(decode_req) -> str:
    """Why every transfer of this pair is refused, when its roles run unequal attention TP sizes
    over NIXL (its head-sliced sender, which H8 does not cover: it needs GPUs to run, so it has
    no test here); empty otherwise."""
    receiver = decode_req.kv_receiver
    manager = getattr(receiver, "kv_mgr", None)
    prefill = getattr(getattr(receiver, "prefill_info", None), "attn_tp_size", None)
    decode = getattr(manager, "attn_tp_size", None)
    sliced = prefill and decode and prefill != decode and not getattr(manager, "is_mla_backend", False)
    nixl = ".nixl." in type(manager).__module__
    return UNEQUAL_TP.format(prefill=prefill, decode=decode) if sliced and nixl else ""


def release(decode_req) -> None:
    """Seam in decode's `_do_release` (and after the check): the room's epoch is forgotten and its
    pages stop vouching for anyone, so a late write or a stale reader matches nothing."""
    tags = _decode_tags(decode_req)
    room, epoch = decode_req.req.bootstrap_room, getattr(decode_req, "hardened_epoch", None)
    if tags is not None and epoch is not None and tags.expected.get(room) == epoch:
        tags.release(room)  # not if the room has been allocated again since
    decode_req.hardened_epoch = decode_req.hardened_count = None  # a check still pending is dropped
