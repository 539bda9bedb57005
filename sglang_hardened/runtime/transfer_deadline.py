"""H6 on NIXL: no wait on posted transfer handles outlasts the release timeout.

NIXL posts a write and the transfer worker polls its handles until every one
is DONE. Over UCX TCP a write to a peer that is alive but stopped (SIGSTOP,
swapping, a hung host) is neither DONE nor ERR, ever: upstream waits for
good, 0.5.19 in its handle loop and 0.5.20-0.5.23 in ``_await_handles``
("unbounded while every handle is still healthy"), and so does H8's tag-row
wait. The worker then serves no other room, and prefill never answers the
request. A dead peer raises by itself; a stopped one does not.

``Wait`` bounds such a wait at the deadline (the deferred-release timeout,
Mooncake's own per-call timeout plays the same role there). Past it the
wait counts as failed, by upstream's own failure path: the room fails, its
chunk stays counted in the worker (no drain ack, so decode holds its pages
under H5's rules, and prefill holds its source pages under ``source_hold``).
A write given up on is not cancelled: it may still land once the peer runs.
The handles are watched on a daemon thread until they settle, and that is
logged, so an operator sees when the last write of a failed room landed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .transfer_bounds import process_release_timeout_s

SETTLED = ("DONE", "ERR")
WATCH_INTERVAL_S = 0.05

log = logging.getLogger("sglang_hardened")


class TransferDeadline(RuntimeError):
    """A wait on posted transfer handles passed its deadline."""


class Wait:
    """One wait on ``handles`` posted through ``agent``, begun when created."""

    def __init__(self, agent, handles: Sequence[Any], what: str = "NIXL transfer",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.agent, self.handles, self.what, self.clock = agent, handles, what, clock
        self.started = clock()
        self.given_up = False

    def expired(self) -> bool:
        """Seam, in the poll loop while every handle is healthy: has the wait lasted its
        deadline? The first time it has, the handles are handed to the watcher (logged)."""
        if self.given_up:
            return True
        waited = self.clock() - self.started
        if waited < process_release_timeout_s():
            return False
        self.given_up = True
        log.warning("sglang-hardened H6: a %s has not settled after %.0f s (the release timeout); failing it "
                    "(its peer is stalled or unreachable; the write may still land once it runs)", self.what, waited)
        _watch(self.agent, list(self.handles), self.what)
        return True

    def check(self) -> None:
        """Raise ``TransferDeadline`` once ``expired`` (loops that fail by raising)."""
        if self.expired():
            raise TransferDeadline(f"sglang-hardened H6: {self.what} not settled within the release timeout "
                                   f"({process_release_timeout_s():.0f} s)")


def _watch(agent, handles: list[Any], what: str) -> None:
    threading.Thread(target=_until_settled, args=(agent, handles, what), name="sglang-hardened-abandoned-write",
                     daemon=True).start()


def _until_settled(agent, handles: list[Any], what: str) -> None:
    """Poll handles given up on until each is DONE or ERR; log when they did."""
    since = time.monotonic()
    pending = list(handles)
    while pending:
        try:
            pending = [h for h in pending if agent.check_xfer_state(h) not in SETTLED]
        except Exception as exc:  # the agent went away with its handles: nothing more can land
            log.warning("sglang-hardened H6: a %s given up on can no longer be read (%s)", what, exc)
            return
        time.sleep(WATCH_INTERVAL_S)
    log.warning("sglang-hardened H6: a %s given up on settled %.1f s later", what, time.monotonic() - since)
