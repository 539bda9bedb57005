"""H5 on prefill: a failed request keeps its source KV pages while its transfer still reads them.

A prefill request that fails mid-send (an abort from its client, from decode
or an operator; a failure on another rank) is seen as Failed on the inflight
queue's next poll, and upstream releases its KV pages there and then. The
transfer worker may still be inside a call that reads those pages (Mooncake's
synchronous batch, NIXL's posted handles): once the pages go to the next
request and its forward overwrites them, the call carries that request's KV
into this room's decode pages, and a Mooncake last chunk that returns after
the abort still reports Success to decode (a cleared room's status is taken
anew). Upstream's worker already counts, per room, the chunks it has dequeued
and not finished (``_staging_outstanding``, the predicate its abort ack uses),
so the seam keeps the request in the queue while that count is positive.
A request aborted outside that queue (between chunks of a chunked prefill; a
chunk's result that comes back aborted) is released by other upstream code;
there the seam parks the release until the count drops, and the inflight pass
runs the parked releases every scheduler iteration.

Either hold lasts at most ``HOLD_TIMEOUTS`` deferred-release timeouts: a
Mooncake call ends within one timeout of its start (H6's bound, Mooncake's
own per-call timeout), and its post may still have been queued when the room
failed. It is bounded because a NIXL write into a stalled peer has no end
of its own (``nixl_drain``'s watcher holds the room until it settles), which
would otherwise hold the pages for as long as the peer is stalled. Such a
write may then read pages given to another request, into the decode pages of
a room that failed, which decode holds until prefill's drain ack
(``release_guard``) and never reads. Past it the pages go back, logged.

With tensor parallelism each rank has its own worker and count, and one rank's
transfer can fail while another's still sends. The ranks must still keep or
release the same requests at the same iteration (else their queues and free
pools diverge and the next collective hangs prefill), so every decision here is
shared over the scheduler's groups (``rank_agreement``): a request is held
while any rank still holds it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

from . import metrics, nixl_drain
from .rank_agreement import any_rank, scheduler_groups
from .release_timeout import process_release_timeout_s

log = logging.getLogger("sglang_hardened")

HOLD_TIMEOUTS = 2
_EXPIRED = float("-inf")  # a hold that ran out: never held again
_held_since: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()


def _in_flight(sender) -> int:
    """Chunks of the sender's room the transfer worker has dequeued and not finished (0 for a
    sender with no worker, such as a warm-up request's); at least 1 while ``nixl_drain``'s
    watcher holds writes of the room given up on. The count alone is not enough there: the
    worker skips the room's next queued chunk once the room failed and pops the whole count,
    the given-up writes' included (a cached prompt's prefix goes as a chunk of its own)."""
    manager = getattr(sender, "kv_mgr", None)
    counts = getattr(manager, "_staging_outstanding", None)
    queued = counts.get(sender.bootstrap_room, 0) if counts is not None else 0
    return max(queued, 1) if manager is not None and nixl_drain.holds(manager, sender.bootstrap_room) else queued


def _within_hold(since: float, now: float) -> bool:
    """Whether a hold that began at ``since`` may still last at ``now``."""
    return now - since < HOLD_TIMEOUTS * process_release_timeout_s()


def _ran_out(sender, held_s: float) -> None:
    """Say, as a warning, that a hold ended on its bound: the pages may go back under a write."""
    metrics.hold_ended("prefill", "ran_out", held_s)
    log.warning("sglang-hardened H5: room %s: the transfer still reads its prefill KV pages after %.0f s (%d release "
                "timeouts); they go back", sender.bootstrap_room, held_s, HOLD_TIMEOUTS)


def still_sending(sender, scheduler: object | None = None, clock: Callable[[], float] = time.monotonic) -> bool:
    """Seam, prefill's inflight queue on a Failed poll: must the request keep its pages?

    True while the transfer worker of any of ``scheduler``'s ranks still reads the room's
    source pages, for at most ``HOLD_TIMEOUTS`` release timeouts from the first poll that asked.
    """
    return any_rank([_held_here(sender, clock)], scheduler_groups(scheduler))[0]


def _held_here(sender, clock: Callable[[], float]) -> bool:
    """``still_sending`` as this rank's own worker sees it."""
    if _in_flight(sender) <= 0:
        if (since := _held_since.pop(sender, _EXPIRED)) != _EXPIRED:
            metrics.hold_ended("prefill", "writes_done", clock() - since)
            log.info("sglang-hardened H5: room %s: the transfer stopped reading; its prefill KV pages go back",
                     sender.bootstrap_room)
        return False
    now, since = clock(), _held_since.get(sender)
    if since == _EXPIRED:
        return False
    if since is None:
        since = _held_since[sender] = now
        metrics.hold_started("prefill")
        log.warning("sglang-hardened H5: room %s failed while the transfer still reads its prefill KV pages; "
                    "they stay held until it returns", sender.bootstrap_room)
    if _within_hold(since, now):
        return True
    _ran_out(sender, now - since)
    _held_since[sender] = _EXPIRED
    return False


_parked: dict[int, tuple[object, object, float, Callable[[], None]]] = {}  # id(req): req, sender, since, release


def release_when_sent(req, sender, release: Callable[[], None], scheduler: object | None = None,
                      clock: Callable[[], float] = time.monotonic) -> None:
    """Seam, prefill's releases of an aborted request outside the inflight queue (an abort
    between chunks; a chunk's result that comes back aborted): ``release`` now, or, while the
    transfer of any of ``scheduler``'s ranks still reads the request's pages, once none does
    (``release_parked``)."""
    if id(req) in _parked:
        return
    if sender is None or not any_rank([_in_flight(sender) > 0], scheduler_groups(scheduler))[0]:
        release()
        return
    _parked[id(req)] = (req, sender, clock(), release)
    metrics.hold_started("prefill")
    log.warning("sglang-hardened H5: room %s was aborted while the transfer still reads its prefill KV pages; "
                "their release waits until it returns", sender.bootstrap_room)


def parked(req: object | None = None) -> bool:
    """Whether ``req``'s release (any release, for None) waits: such a request is retired already,
    and a scheduler with one is not idle (its pages are neither free nor a leak)."""
    return id(req) in _parked if req is not None else bool(_parked)


def release_parked(scheduler: object | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Seam, every prefill scheduler iteration: run the parked releases whose transfer stopped
    reading on every rank, or whose hold ran out there (``HOLD_TIMEOUTS`` release timeouts,
    logged). Every rank parks the same requests in the same order, so they agree entry by entry."""
    if not _parked:
        return
    now = clock()
    entries = list(_parked.items())
    sending = [_in_flight(sender) > 0 for _, (_, sender, _, _) in entries]  # read once: what this rank decided on
    keep_here = [busy and _within_hold(since, now) for busy, (_, (_, _, since, _)) in zip(sending, entries)]
    for (key, (_, sender, since, release)), busy, keep in zip(entries, sending,
                                                             any_rank(keep_here, scheduler_groups(scheduler))):
        if keep:
            continue
        if not busy:
            metrics.hold_ended("prefill", "writes_done", now - since)
            log.info("sglang-hardened H5: room %s: the transfer stopped reading; its aborted request's prefill KV "
                     "pages go back", sender.bootstrap_room)
        else:
            _ran_out(sender, now - since)
        del _parked[key]
        release()
