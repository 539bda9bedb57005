"""Page ledger (test instrumentation): when decode pages are exposed, written and freed.

Applied by the overlay's edits to upstream and hardened builds alike, so one
oracle judges both: a decode page must not go back to the free list while a
write into it may still land. Off unless ``SANDBOX_LEDGER_DIR`` is set; each
process appends JSON lines to ``<dir>/<pid>.jsonl``, stamped with
CLOCK_MONOTONIC (one clock for every process on the host):

- decode ``expose`` {room, pages}: decode sent prefill these page indices for
  the room; from now on prefill may write into them.
- decode ``free`` {pages}: these pages went back to the free list.
- prefill ``begin`` {room, pages, src} / ``end`` {room, rc}: one synchronous
  Mooncake call from prefill pages ``src`` into decode ``pages`` started /
  returned; a NIXL write posted / every handle of its chunk settled DONE, or,
  for handles the worker gave up on, the hardened runtime's watcher logged
  that they settled (``rc`` null).
- prefill ``srcfree`` {pages}: prefill pages went back to its free list.

``tests/e2e/ledger.py`` reads the files and reports every decode page freed
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

import json
import logging
import os
import threading
import time

DIR_ENV = "SANDBOX_LEDGER_DIR"
SLOW_ENV = "SANDBOX_SLOW_SEND_S"
SLOW_SWITCH_ENV = "SANDBOX_SLOW_SWITCH"
SLOW_MIN_PAGES = 16

_lock = threading.Lock()
_exposed_here = False  # a process that exposes pages (decode) records its frees as ``free``
_sending_here = False  # one that writes into them (prefill) records its own as ``srcfree``


def _record(ev: str, **fields) -> None:
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    line = json.dumps({"t": time.monotonic(), "ev": ev, **fields}) + "\n"
    with _lock, open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line)


class _Settled(logging.Handler):
    """The hardened runtime logs (with ``settled_room``) when NIXL writes it gave up on settled."""

    def emit(self, record: logging.LogRecord) -> None:
        room = getattr(record, "settled_room", None)
        if room is not None:
            _record("end", room=int(room), rc=None)


logging.getLogger("sglang_hardened").addHandler(_Settled())


def _ints(indices) -> list[int]:
    return [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]


def exposed(room, page_indices) -> None:
    """Decode, right before it sends prefill the room's page indices."""
    global _exposed_here
    _exposed_here = True
    _record("expose", room=int(room), pages=_ints(page_indices))


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


def _begin(req, dst_pages, src_pages) -> tuple[int, list[int]]:
    """Record a write from prefill pages into decode pages beginning; slow it if asked (see
    the module doc)."""
    global _sending_here
    _sending_here = True
    room, pages = int(req.room), _ints(dst_pages)
    _record("begin", room=room, pages=pages, src=_ints(src_pages))
    switch = os.environ.get(SLOW_SWITCH_ENV)
    if len(pages) >= SLOW_MIN_PAGES and os.environ.get(SLOW_ENV) and (not switch or os.path.exists(switch)):
        time.sleep(float(os.environ[SLOW_ENV]))
    return room, pages


# Every base calls send_kvcache(session or agent, prefill page indices, decode pointers,
# decode page indices, ...), on Mooncake and NIXL alike.
SRC_ARG = 1


def writing(req, dst_pages, send):
    """Prefill's Mooncake transfer worker: ``send`` wrapped so the call is recorded (and slowed)."""
    def call(*args, **kwargs):
        room, _ = _begin(req, dst_pages, args[SRC_ARG])
        rc = None
        try:
            rc = send(*args, **kwargs)
            return rc
        finally:
            _record("end", room=room, rc=rc if isinstance(rc, int) else None)
    return call


def posting(req, dst_pages, post):
    """Prefill's NIXL transfer worker: ``post`` wrapped so the write's start is recorded
    (and slowed); ``landed`` records its end."""
    def call(*args, **kwargs):
        _begin(req, dst_pages, args[SRC_ARG])
        return post(*args, **kwargs)
    return call


def landed(room) -> None:
    """Prefill's NIXL transfer worker, once every handle of the room's chunk is DONE."""
    _record("end", room=int(room), rc=None)
