"""H8 seams for the NIXL backend: the same tags, frames and check as Mooncake (`page_tags.seams`),
moved by a NIXL agent.

- Both roles' `NixlKVManager.register_buffer_to_engine` make the tag buffer (`register`) and
  register it with the agent: VRAM on `gpu_id` when the pool is on CUDA, else DRAM (device 0),
  the way upstream registers KV and aux memory.
- Decode's registration and metadata messages carry the same trailing frames, and prefill's
  bootstrap thread strips them, with `tags_frame`, `epoch_frame` and `carried` (re-exported
  here so that NIXL's conn.py imports one module).
- Prefill's transfer worker calls `send_tags` right before `send_kvcache` to one destination: it
  stamps the chunk's prefill pages in its own lane of rows (`before_send`) and posts one more
  NIXL write, the tag rows from prefill page to decode page with the chunk's page mapping. NIXL
  writes are asynchronous, so the write must be complete before decode is told the chunk
  arrived:
  - 0.5.23 (prefill reports success once every handle of the chunk is DONE): the tag handle is
    appended to the chunk's handles, so it is waited on with the KV's; the lane's next stamp of
    other values first waits for it, at most one release timeout (it may still be reading the
    rows: requests that share cached prefix pages send the same prefill pages);
  - 0.5.19-0.5.22 (decode counts the KV write's own notification): `send_tags` waits for the
    tag write itself before returning, so the KV (and its notification) is posted after it; a
    wait past the release timeout fails the chunk and leaves the write to `nixl_drain`'s
    watcher, so the room's drain ack waits for it.
  A tag thus reaches decode only for pages whose KV this chunk sends; if the KV write then fails
  the room fails, and decode releases (resets) the rows without checking them.

Decode's tag buffer is taken to be the same kind of memory as prefill's (both CUDA, or both
CPU): decode sends only its address. The decode-side seams (`allocate`, `verdict_pending`, `refuse_untagged`,
`release`) are backend-neutral and live in `page_tags.seams`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import nixl_drain
from .rows import SourceTags, TagBuffer
from .seams import before_send, carried, decode_rows, epoch_frame, make_tags, tags_frame

__all__ = ["carried", "epoch_frame", "register", "send_tags", "tags_frame"]


def _mem(buffer: TagBuffer | SourceTags, gpu_id: int) -> tuple[str, int]:
    """NIXL's (memory kind, device id) for a tag buffer: VRAM on its GPU, or DRAM (device 0)."""
    return ("VRAM", gpu_id) if buffer.device.type == "cuda" else ("DRAM", 0)


def register(manager) -> None:
    """Seam at the end of `NixlKVManager.register_buffer_to_engine`: make the tag buffer and
    register it with the manager's NIXL agent (the descriptors are kept so it stays registered)."""
    buffer = make_tags(manager)
    if buffer is None:
        return
    ptr, nbytes, _ = buffer.buf_info()
    kind, device = _mem(buffer, manager.kv_args.gpu_id)
    manager.hardened_tag_descs = manager.agent.register_memory([(ptr, nbytes, device, "")], kind)
    if not manager.hardened_tag_descs:
        raise RuntimeError(f"sglang-hardened H8: NIXL registration of the {kind} tag buffer failed")
    manager.hardened_tag_writes = {}  # id(lane) -> ((room, epoch), its posted, unwaited writes)


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src start, dst start, length) of the runs where both page lists advance by one together."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lengths


def _state(manager, handle, until: float) -> str | None:
    """Wait until a posted write is DONE or ERR and say which; None once `until` passes (a
    stalled peer)."""
    while (state := manager.agent.check_xfer_state(handle)) not in nixl_drain.SETTLED:
        if nixl_drain.passed(until):
            return None
        time.sleep(0)
    return state


def _settle(manager, handle, room: int) -> None:
    """Wait until the tag write is DONE; raise (the worker then fails the room) if it failed, or
    at the release timeout, leaving the write to `nixl_drain`'s watcher: the room's drain ack
    waits for it."""
    state = _state(manager, handle, nixl_drain.deadline(manager))
    if state is None:
        nixl_drain.abandon(manager, room, [handle])
        raise RuntimeError("sglang-hardened H8: NIXL tag-row write not settled within the release timeout")
    if state == "ERR":
        raise RuntimeError("sglang-hardened H8: NIXL tag-row write failed")


def _settle_lane(manager, lane: TagBuffer, stamp: tuple[int, int]) -> None:
    """Before a lane's rows are stamped with `stamp`: wait for its posted writes that carry other
    values, which may still be reading the rows (a failed one reads nothing more), at most one
    release timeout, once. A write still unsettled then belongs to a stalled peer's room, among
    whose handles it is (that room's drain ack waits for it): restamping under it can only get
    that room refused, never vouch for another's pages, and the lane serves other rooms on."""
    pending = manager.hardened_tag_writes.get(id(lane))
    if pending is None or pending[0] == stamp:
        return  # nothing posted, or the same room's next chunk: its writes carry these values too
    del manager.hardened_tag_writes[id(lane)]
    until = nixl_drain.deadline(manager)
    for handle in pending[1]:
        if _state(manager, handle, until) is None:
            return


def send_tags(manager, kv_chunk, req, dst_indices, handles: list[Any] | None = None):
    """Seam in the NIXL transfer worker right before `send_kvcache` to one destination: stamp the
    chunk's prefill pages with the destination's (room, epoch) in this worker's lane and post the
    tag-row write to the same decode pages. With `handles` (0.5.23) the write joins the chunk's
    handles; without (0.5.19-0.5.22) it is waited for here. Returns the prefill and decode page
    indices to send."""
    src_indices = kv_chunk.prefill_kv_indices
    tags, epoch = getattr(manager, "hardened_tags", None), getattr(req, "hardened_h8", None)
    if tags is None or epoch is None or len(src_indices) == 0:
        return src_indices, dst_indices  # no tags either side: decode refuses what it cannot check
    lane, stamp = tags.lane(), (req.room, epoch)
    src_ptr, _, item_len = lane.buf_info()
    dst_ptr = decode_rows(manager, req.agent_name, item_len)
    if dst_ptr is None:
        return src_indices, dst_indices
    _settle_lane(manager, lane, stamp)
    before_send(manager, kv_chunk, req, dst_indices)
    dst_info = manager.decode_kv_args_table[req.agent_name]
    src_kind, src_dev = _mem(lane, manager.kv_args.gpu_id)
    dst_dev = dst_info.gpu_id if src_kind == "VRAM" else 0
    n = min(len(src_indices), len(dst_indices))
    src_start, dst_start, lengths = _runs(np.asarray(src_indices[:n], dtype=np.uint64),
                                          np.asarray(dst_indices[:n], dtype=np.uint64))
    size = lengths.astype(np.uint64) * np.uint64(item_len)

    def descs(base: int, starts: np.ndarray, device: int):
        table = np.column_stack((np.uint64(base) + starts * np.uint64(item_len), size,
                                 np.full_like(starts, device)))
        return manager.agent.get_xfer_descs(table.astype(np.uint64), src_kind)

    handle = manager.agent.initialize_xfer("WRITE", descs(src_ptr, src_start, src_dev),
                                           descs(dst_ptr, dst_start, dst_dev), req.agent_name)
    if not handle or manager.agent.transfer(handle) == "ERR":
        raise RuntimeError("sglang-hardened H8: NIXL tag-row write could not be posted")
    if handles is None:
        _settle(manager, handle, req.room)
    else:
        handles.append(handle)
        manager.hardened_tag_writes.setdefault(id(lane), (stamp, []))[1].append(handle)
    return src_indices, dst_indices
