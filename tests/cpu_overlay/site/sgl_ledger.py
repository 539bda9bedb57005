"""Page ledger (test instrumentation): when decode pages are exposed, written and freed.

Applied by the overlay's edits to upstream and hardened builds alike, so one
oracle judges both: a decode page must not go back to the free list while a
write into it may still land. Off unless ``SANDBOX_LEDGER_DIR`` is set; each
process appends JSON lines to ``<dir>/<pid>.jsonl``, stamped with
CLOCK_MONOTONIC (one clock for every process on the host):

- decode ``expose`` {room, pages, tokens}: decode sent prefill these page indices for
  the room; from now on prefill may write into them. Decode will attend to the
  room's first ``tokens`` positions of them (its prompt).
- prefill ``owns`` {room, slots, page_size}: as prefill sends a chunk, the token
  slots holding the room's KV, position by position (its own or a cached prefix's).
- decode ``free`` {pages}: these pages went back to the free list.
- prefill ``begin`` {room, w, pages, src} / ``end`` {room, w, rc}: write ``w``
  (a number per process) from prefill pages ``src`` into decode ``pages``
  started / ended. A synchronous Mooncake call ends when it returns; a NIXL
  write when the transport itself first reports its handle DONE
  (``nixl_agent.check_xfer_state``, whoever asks: upstream's worker or the
  hardened runtime's watcher), never on the word of the code being judged.
  ERR ends nothing (a rejected post may have put writes on the wire); the
  fault stand-ins (``sgl_faults``), which make such writes, say when theirs
  settled (``landed``: an ``end`` with no ``w``, for the room's oldest open
  write).
- prefill ``srcfree`` {pages}: prefill pages went back to its free list.
- every record, with a batch in flight (``sgl_inflight``'s mode), ``in_flight``: how many of the
  writing process's forwards were unfinished then.
- prefill ``call`` {room, w, entries, bytes, longest, rc}: one Mooncake engine call
  (``TransferEngine.batch_transfer_sync_write``, below every split SGLang or the
  hardened layer makes) returned (``rc`` None: it raised); ``longest`` is its longest
  entry in bytes, and ``room``/``w`` name the KV write it belongs to (None: a call outside
  one, on another thread or for the aux and state data).

``sglang_hardened/sandbox/ledger.py`` reads the files and reports every decode page freed
after its exposure and before a write into it for that exposure ended, and
every prefill page freed while a write was reading it.

``SANDBOX_SLOW_SEND_S`` stands in for a slow link (a CPU host moves a
tiny model's KV in microseconds): a call into at least ``SLOW_MIN_PAGES``
pages waits that long after ``begin`` before it writes, so an abort can
arrive while the transfer is in flight; the write itself is real and lands
after the wait. With ``SANDBOX_SLOW_SWITCH`` set to a path, only while that
file exists (a test slows the one request it catches mid-transfer, not the
traffic around it).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

DIR_ENV = "SANDBOX_LEDGER_DIR"
SLOW_ENV = "SANDBOX_SLOW_SEND_S"
SLOW_SWITCH_ENV = "SANDBOX_SLOW_SWITCH"
SLOW_MIN_PAGES = 16

_lock = threading.Lock()
_writes = itertools.count(1)
_posted: dict[object, tuple[int, int]] = {}  # a NIXL handle not yet settled: (room, w)
_posted_lock = threading.Lock()
_sending = threading.local()  # ``current``: the (room, w) this thread's Mooncake write is making
_exposed_here = False  # a process that exposes pages (decode) records its frees as ``free``
_sending_here = False  # one that writes into them (prefill) records its own as ``srcfree``


def _record(ev: str, **fields) -> None:
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    inflight = sys.modules.get("sgl_inflight")  # its mode: how many batches were unfinished then
    if inflight and os.environ.get(inflight.DELAY_ENV):
        fields["in_flight"] = inflight.pending()
    line = json.dumps({"t": time.monotonic(), "ev": ev, **fields}) + "\n"
    with _lock, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line)


def _ints(indices) -> list[int]:
    return [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]


def exposed(room, page_indices, tokens: int) -> None:
    """Decode, right before it sends prefill the room's page indices."""
    global _exposed_here
    _exposed_here = True
    _record("expose", room=int(room), pages=_ints(page_indices), tokens=int(tokens))


def owns(room, slots, page_size: int) -> None:
    """Prefill, as it sends a chunk of the room: the slots of its positions so far."""
    if not os.environ.get(DIR_ENV):
        return  # the slots are a tensor: not converted for nothing
    _record("owns", room=int(room), slots=_ints(slots), page_size=int(page_size))


def _freed(pages: set[int]) -> None:
    if _exposed_here:
        _record("free", pages=sorted(pages))
    elif _sending_here:
        _record("srcfree", pages=sorted(pages))


def freed(token_indices, page_size: int) -> None:
    """An allocator, where token slots go back to the free list."""
    _freed({i // page_size for i in _ints(token_indices)})


def freed_pages(*page_ids) -> None:
    """A paged allocator, where pages go back to the free list."""
    _freed({p for ids in page_ids for p in _ints(ids)})


def _begin(req, dst_pages, src_pages) -> tuple[int, int]:
    """Record a write from prefill pages into decode pages beginning; slow it if asked (see
    the module doc). Returns (room, w)."""
    global _sending_here
    _sending_here = True
    room, pages, w = int(req.room), _ints(dst_pages), next(_writes)
    _record("begin", room=room, w=w, pages=pages, src=_ints(src_pages))
    switch = os.environ.get(SLOW_SWITCH_ENV)
    if len(pages) >= SLOW_MIN_PAGES and os.environ.get(SLOW_ENV) and (not switch or os.path.exists(switch)):
        time.sleep(float(os.environ[SLOW_ENV]))
    return room, w


# Every base calls send_kvcache(session or agent, prefill page indices, decode pointers,
# decode page indices, ...), on Mooncake and NIXL alike.
SRC_ARG = 1


def writing(req, dst_pages, send):
    """Prefill's Mooncake transfer worker: ``send`` wrapped so the call is recorded (and slowed)."""
    def call(*args, **kwargs):
        room, w = _begin(req, dst_pages, args[SRC_ARG])
        _watch_calls(sys.modules["mooncake.engine"].TransferEngine)
        _sending.current = (room, w)
        rc = None
        try:
            rc = send(*args, **kwargs)
            return rc
        finally:
            _sending.current = (None, None)
            _record("end", room=room, w=w, rc=rc if isinstance(rc, int) else None)
    return call


def _watch_calls(engine_class) -> None:
    """Wrap Mooncake's ``batch_transfer_sync_write`` once, so each engine call is recorded with
    what it carried, whoever split the transfer into it."""
    with _lock:  # several transfer workers: one wrap, or each call would be recorded twice
        write = engine_class.batch_transfer_sync_write
        if getattr(write, "_ledger", False):
            return

        def batch_transfer_sync_write(engine, peer, srcs, dsts, lengths):
            rc = None
            try:
                rc = write(engine, peer, srcs, dsts, lengths)
                return rc
            finally:
                room, w = getattr(_sending, "current", (None, None))
                _record("call", room=room, w=w, entries=len(lengths), bytes=int(sum(lengths)),
                        longest=int(max(lengths, default=0)), rc=rc if isinstance(rc, int) else None)

        batch_transfer_sync_write._ledger = True
        engine_class.batch_transfer_sync_write = batch_transfer_sync_write


def posting(req, dst_pages, post):
    """Prefill's NIXL transfer worker: ``post`` wrapped so the write's start is recorded (and
    slowed); its end is the transport's own report (``_watch_settling``)."""
    def call(*args, **kwargs):
        room, w = _begin(req, dst_pages, args[SRC_ARG])
        handle = post(*args, **kwargs)
        if handle is None:  # nothing was posted
            _record("end", room=room, w=w, rc=None)
            return handle
        _watch_settling(sys.modules["nixl._api"].nixl_agent)  # the class every agent here is
        with _posted_lock:
            _posted[handle] = (room, w)
        return handle
    return call


def _watch_settling(agent_class) -> None:
    """Wrap the NIXL agent's ``check_xfer_state`` once, so a posted handle's first DONE,
    reported by the transport to whoever asks, ends its write."""
    check = agent_class.check_xfer_state
    if getattr(check, "_ledger", False):
        return

    def check_xfer_state(agent, handle):
        state = check(agent, handle)
        if state != "PROC":
            with _posted_lock:
                write = _posted.pop(handle, None)
            if write is not None and state == "DONE":
                _record("end", room=write[0], w=write[1], rc=state)
        return state

    check_xfer_state._ledger = True
    agent_class.check_xfer_state = check_xfer_state


def landed(room) -> None:
    """A fault stand-in, once the writes it made for the room outside the worker's post settled
    (it polled the transport itself)."""
    _record("end", room=int(room), rc=None)
