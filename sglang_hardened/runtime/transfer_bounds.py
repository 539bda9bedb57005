"""H6: every synchronous Mooncake transfer call is bounded in entries and in bytes.

A synchronous batch cannot be interrupted, and decode releases a failed
request's pages after SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
even without proof that prefill's writes drained: a call that outlives that
timeout may write into pages decode has given to another request. So one call
carries at most ``timeout x timeout_fraction x link rate`` bytes. Mooncake TCP
also rejects a call of more than about 2,050 entries and then fails every later
call to that peer, whatever the bytes: one call carries at most
``max_entries_per_call`` entries. A larger transfer becomes several calls, in
order, stopping at the first failure (as upstream's own index split does).

Calls made at the same time share the link and the peer's queue (the
per-layer path sends every layer on its own thread), so the bounds hold for
them jointly: a call starts only once the bytes of every call in flight in
the process, and the entries of every call in flight to its peer, leave room
for it (``InFlight``).

A chunk split this way is many calls in a row, and each is bounded, not their
sum. So one send of a chunk to one decode rank (``begin_send``, a seam before
it) stops between calls as soon as the chunk's room has failed (an abort from
decode, a client or another rank): the send returns ``STOPPED`` and the seam
after it (``send_stopped``) drops the chunk the way upstream drops one dequeued
after its room failed (no transport failure: the session is not blamed, and the
drain ack, which waits for the chunk to be done, is kept). After a room fails,
at most the one call in flight still writes, within its bound. A send that has
run ``source_hold.HOLD_TIMEOUTS`` release timeouts (as long as prefill holds a
failed request's source pages) fails its room and stops the same way; prefill
then ends the request, which H4 carries to decode. Calls on other threads (the
per-layer path of custom memory pools) carry no send and are bounded one by
one only.

Defaults live in the policy file's ``limits: H6``; the env vars below override
them (``sglang-hardened launch`` sets them from the same numbers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..common.knobs import TRANSFER_LINK_RATE, TRANSFER_MAX_ENTRIES
from . import metrics
from .release_timeout import process_release_timeout_s, release_timeout_s
from .source_hold import HOLD_TIMEOUTS


Batch = tuple[list[int], list[int], list[int]]  # sources, destinations, lengths: one engine call
Write = Callable[[str, list[int], list[int], list[int]], int]

log = logging.getLogger("sglang_hardened")


@dataclass(frozen=True)
class Bounds:
    """What one synchronous transfer call may carry."""

    max_entries: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError(f"transfer bounds must be positive: {self}")


def split(srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int], bounds: Bounds) -> Iterator[Batch]:
    """Consecutive batches that write exactly the given bytes, in order, each within ``bounds``.

    An entry longer than ``max_bytes`` is cut into pieces (each piece is an
    entry of its own), so the byte bound holds whatever the page size.
    """
    batch: Batch = ([], [], [])
    batch_bytes = 0
    for src, dst, length in zip(srcs, dsts, lengths, strict=True):
        offset = 0
        while offset < length:
            if len(batch[0]) == bounds.max_entries or batch_bytes == bounds.max_bytes:
                yield batch
                batch, batch_bytes = ([], [], []), 0
            piece = min(length - offset, bounds.max_bytes - batch_bytes)
            batch[0].append(src + offset)
            batch[1].append(dst + offset)
            batch[2].append(piece)
            batch_bytes += piece
            offset += piece
    if batch[0]:
        yield batch


def bounds_from(environ: Mapping[str, str]) -> Bounds:
    """The bounds for a process with this environment: the policy's numbers, env overriding."""
    from .policy import knob_value, load_limits

    timeout_s = release_timeout_s(environ)
    link_rate = float(knob_value(TRANSFER_LINK_RATE, environ))
    return Bounds(max_entries=int(knob_value(TRANSFER_MAX_ENTRIES, environ)),
                  max_bytes=int(timeout_s * load_limits("H6")["timeout_fraction"] * link_rate))


@lru_cache(maxsize=1)
def process_bounds() -> Bounds:
    """This process's bounds, read once (the env does not change under a running server)."""
    bounds = bounds_from(os.environ)
    log.info("sglang-hardened H6: each Mooncake transfer call carries at most %d entries and %d bytes",
             bounds.max_entries, bounds.max_bytes)
    return bounds


class InFlight:
    """What the calls under way carry: at most ``max_bytes`` in the process and
    ``max_entries`` to one peer, together. A batch within the bounds waits for room
    (a call in flight ends by itself: Mooncake times it out), then holds it until its
    call returns."""

    def __init__(self) -> None:
        self.bytes = 0
        self.entries: Counter[str] = Counter()
        self._changed = threading.Condition()

    def _fits(self, peer: str, entries: int, nbytes: int, bounds: Bounds) -> bool:
        return self.bytes + nbytes <= bounds.max_bytes and self.entries[peer] + entries <= bounds.max_entries

    def call(self, write: Write, peer: str, batch: Batch, bounds: Bounds) -> int:
        entries, nbytes = len(batch[0]), sum(batch[2])
        with self._changed:
            self._changed.wait_for(lambda: self._fits(peer, entries, nbytes, bounds))
            self.bytes += nbytes
            self.entries[peer] += entries
        try:
            return write(peer, *batch)
        finally:
            with self._changed:
                self.bytes -= nbytes
                self.entries[peer] -= entries
                if not self.entries[peer]:
                    del self.entries[peer]
                self._changed.notify_all()


_in_flight = InFlight()
STOPPED = -2  # what a send returns when its room failed between calls (``send_stopped``)


@dataclass
class _Send:
    """The send this transfer worker thread makes now."""

    manager: object  # the Mooncake KV manager that owns the room's status
    room: int
    deadline: float
    said: bool = False


_current = threading.local()


def begin_send(manager, room: int) -> None:
    """Seam, prefill's Mooncake transfer worker before it sends a chunk to one decode rank: the
    engine calls this thread makes next belong to ``room``'s send, and stop once the room fails
    or the send's deadline passes."""
    _current.send = _Send(manager, room, time.monotonic() + HOLD_TIMEOUTS * process_release_timeout_s())


def send_stopped(ret: int) -> bool:
    """Seam, right after that send returned ``ret``, before upstream's failure handling: ends the
    send (the aux and state writes after it are single calls, bounded only), and says whether its
    calls stopped because the room failed; the worker then drops the chunk (``break``)."""
    _current.send = None
    return ret == STOPPED


def _stop(send: _Send) -> int | None:
    """STOPPED once the send must make no more calls, its room failed (None: it may call on)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager, room = send.manager, send.room
    if manager.request_status.get(room, KVPoll.Failed) == KVPoll.Failed:
        reason, why = "its room failed", "room_failed"
    elif time.monotonic() > send.deadline:
        reason, why = f"it ran for {HOLD_TIMEOUTS} release timeouts; the room fails", "send_deadline"
        manager.record_failure(room, f"sglang-hardened H6: the transfer ran for {HOLD_TIMEOUTS} release timeouts")
        manager.update_status(room, KVPoll.Failed)
    else:
        return None
    if not send.said:
        send.said = True
        metrics.send_stopped(why)
        log.warning("sglang-hardened H6: room %s: no more transfer calls for this send: %s", room, reason)
    return STOPPED


def batch_transfer_sync(write: Write, session_id: str, srcs: list[int], dsts: list[int],
                        lengths: list[int], *, bounds: Bounds | None = None,
                        in_flight: InFlight = _in_flight) -> int:
    """Seam for the engine's synchronous batch write: one bounded call per batch, within
    the room calls on other threads leave; the first non-zero return, after which nothing
    more is sent. ``bounds`` and ``in_flight`` default to the process's own (a test or a
    benchmark drives an engine pair with its own)."""
    bounds = bounds or process_bounds()
    send: _Send | None = getattr(_current, "send", None)
    for batch in split(srcs, dsts, lengths, bounds):
        if send is not None and (stop := _stop(send)) is not None:
            return stop
        metrics.transfer_call(len(batch[0]), sum(batch[2]))
        ret = in_flight.call(write, session_id, batch, bounds)
        if ret != 0:
            return ret
    return 0
