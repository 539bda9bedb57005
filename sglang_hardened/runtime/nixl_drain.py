"""H5/H6 on NIXL: no wait on posted handles outlasts the release timeout, and no drain ack
goes out before the writes given up on have settled.

Over UCX TCP a write into a peer that is alive but stalled (stopped, swapping,
a hung host) is neither DONE nor ERR until the peer runs again: upstream's
transfer worker waits for it ("unbounded while every handle is still
healthy"), and every other room on its queue waits behind it. Upstream also
gives up on a batch 5 s after one handle failed, and then cannot say when
the others land: it poisons the room's drain ack and leaves decode to its
release timeout, which proves nothing about a write still on the wire.

Here the worker's healthy wait (and H8's tag-row wait) ends at the release
timeout (`deadline`, `passed`). A room it gives up on, or one whose siblings
did not settle after a failure, is failed and told to decode at once
(`take_unsettled`; 0.5.19, whose one failure path never acked, `take_failed`),
but its handles go to a watcher thread (`Drain`), which keeps the room's
chunk counted and its drain ack back until every handle is DONE or ERR; then
it clears the count and sends the ack through upstream's own
`_maybe_ack_drained_abort`, which the seam `holds` keeps shut meanwhile.
A post that NIXL rejected (`take_rejected`) leaves no handle for what it may
have put on the wire: its ack also waits one release timeout from the
rejection, the trust upstream's decode-side timeout gave it, kept by the
prefill process whose writes they are. Decode, for its part, waits for the ack or
for prefill to be gone (`release_guard`: NIXL writes have no bound, so a
prefill running for a timeout proves nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .release_timeout import process_release_timeout_s

SETTLED = ("DONE", "ERR")
POLL_S = 0.05

log = logging.getLogger("sglang_hardened")


def _acks_drain(manager) -> bool:
    """Whether the manager acks drained rooms (deferred release on): without it there is no ack
    to keep back, and upstream's own waits and failure paths stay."""
    return getattr(manager, "enable_deferred_decode_kv_release", False)


def deadline(manager) -> float:
    """Seam at the start of `_await_handles`: when the wait on healthy handles ends (monotonic);
    never without a drain ack to keep back (upstream's unbounded wait)."""
    if not _acks_drain(manager):
        return float("inf")
    return time.monotonic() + process_release_timeout_s()


def passed(until: float) -> bool:
    """Seam in the wait on healthy handles: give up (as an unsettled batch) once True, logged."""
    if time.monotonic() < until:
        return False
    log.warning("sglang-hardened H6: NIXL writes neither done nor failed after the release timeout (%.0f s): "
                "the peer is stalled or unreachable; giving up the wait, not the writes", process_release_timeout_s())
    return True


@dataclass
class _Room:
    handles: list[Any]
    not_before: float  # monotonic: the earliest the ack may go (a rejected post's grace)
    since: float
    unreadable: bool = False  # a handle's state could not be read (logged once)


class Drain:
    """One manager's rooms whose drain ack waits for writes the worker no longer waits on."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def holds(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def adopt(self, room: int, handles: Sequence[Any], grace_s: float = 0.0) -> None:
        now = time.monotonic()
        with self._lock:
            held = self._rooms.get(room)
            if held is not None:  # a room's chunks run on one worker, in order: later handles join
                held.handles.extend(handles)
                held.not_before = max(held.not_before, now + grace_s)
            else:
                self._rooms[room] = _Room(list(handles), now + grace_s, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sglang-hardened-nixl-drain", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                rooms = list(self._rooms.items())
            for room, held in rooms:
                if self._settled(room, held):
                    self._release(room, held)
            time.sleep(POLL_S)

    def _settled(self, room: int, held: _Room) -> bool:
        """Every handle DONE or ERR and the grace over; then the room is no longer held. One
        whose state cannot be read counts as running (as upstream's `_await_handles` has it):
        it does not prove the write is over."""
        with self._lock:
            pending = list(held.handles)
        try:
            done = {id(h) for h in pending if self.manager.agent.check_xfer_state(h) in SETTLED}
        except Exception as exc:
            if not held.unreadable:
                held.unreadable = True
                log.warning("sglang-hardened H5: room %s: a NIXL write given up on cannot be read (%s); its drain "
                            "ack stays back (decode holds the pages until prefill is gone)", room, exc)
            return False
        with self._lock:  # the worker may have added handles meanwhile: only those read settled go
            held.handles = [h for h in held.handles if id(h) not in done]
            if held.handles or time.monotonic() < held.not_before:
                return False
            del self._rooms[room]
            return True

    def _release(self, room: int, held: _Room) -> None:
        # Nothing else of the room is in flight: its chunks run on one worker, in order, and the
        # later ones are skipped once it failed (a skip may already have popped the count).
        self.manager._staging_outstanding.pop(room, None)
        log.warning("sglang-hardened H5: room %s: the NIXL writes given up on settled %.1f s later; its drain ack "
                    "goes out", room, time.monotonic() - held.since)
        self.manager._maybe_ack_drained_abort(room)


def _drain(manager) -> Drain:
    drain = getattr(manager, "hardened_drain", None)
    if drain is None:
        drain = manager.hardened_drain = Drain(manager)
    return drain


def holds(manager, room: int) -> bool:
    """Seam at the top of `_maybe_ack_drained_abort` (every ack path: the worker's skips, the
    sender's `clear`, decode's ABORT): the watcher owns this room's ack for now."""
    drain = getattr(manager, "hardened_drain", None)
    return drain is not None and drain.holds(room)


def abandon(manager, room: int, handles: Sequence[Any], grace_s: float = 0.0) -> bool:
    """The worker stops waiting on `handles` of `room`: the watcher keeps the room's count and ack
    until they settled and `grace_s` passed. False (nothing taken) without deferred release."""
    if not _acks_drain(manager):
        return False
    _drain(manager).adopt(room, handles, grace_s)
    return True


def take_unsettled(manager, room: int, handles: Sequence[Any], reason: str) -> bool:
    """Seam on the worker's unsettled branch (0.5.20+: a handle may still write into decode's
    pages): True when the watcher took the room, failed and told to decode at once; False to
    leave it to upstream (no deferred release: no ack to keep back)."""
    if not abandon(manager, room, handles):
        return False
    log.warning("sglang-hardened H5: room %s: NIXL writes not settled (%s); failing the room, its drain ack "
                "waits until they settle", room, reason)
    manager.conclude_failure(bootstrap_room=room, failure_reason=reason)
    return True


def take_rejected(manager, room: int, handles: Sequence[Any]) -> None:
    """Seam where 0.5.23 poisons a room whose post NIXL rejected (no handle tracks what it may
    have put on the wire): the ack waits for the posted handles and one release timeout from now."""
    abandon(manager, room, handles, grace_s=process_release_timeout_s())


def take_failed(manager, room: int, handles: Sequence[Any]) -> None:
    """Seam on 0.5.19's failure path, which leaves the chunk counted and never acks: every error
    lands there (a first ERR with siblings running, a rejected post, the deadline), so the ack
    waits for the handles posted and one release timeout from now, as `take_rejected`'s."""
    if abandon(manager, room, handles, grace_s=process_release_timeout_s()):
        log.warning("sglang-hardened H5: room %s failed mid-send; its drain ack waits until its NIXL writes "
                    "settle, and at least one release timeout", room)
