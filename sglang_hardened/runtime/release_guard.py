"""H5: a held decode page goes back only when no write into it can still land.

Decode holds a failed request's pages until every prefill rank acks that its
writes drained, or until SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
passes; upstream then releases anyway. A timeout proves nothing about a prefill
that is alive but stalled (stopped, swapping, a hung NIC): it writes into the
pages when it resumes, after decode gave them to another request. So past the
timeout a hold ends only once every rank that holds the room's page indices is
gone: its rank endpoint (the ZMQ socket its own process binds) refuses TCP
connections for ``GONE_GRACE_S``, time enough for what a dead sender already put
on the wire to be applied. A rank that accepts, or does not answer (a partition),
keeps the hold: the pages stay out of use, logged, until it acks or is gone.

Probes run on one daemon thread, never on the scheduler's: the seam reads the
last verdict.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable

PROBE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 1.0
GONE_GRACE_S = 1.0

Endpoint = tuple[str, int]

log = logging.getLogger("sglang_hardened")


def refuses(endpoint: Endpoint, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True only when the endpoint actively refuses a TCP connection (no process
    listens there); accepting, timing out or an unreachable route say nothing."""
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


class PeerWatch:
    """Probes the endpoints asked about in the background; says which have been gone
    long enough. An endpoint nobody asked about for ``idle_s`` is no longer probed."""

    def __init__(self, interval_s: float = PROBE_INTERVAL_S, grace_s: float = GONE_GRACE_S,
                 idle_s: float = 10.0) -> None:
        self.interval_s, self.grace_s, self.idle_s = interval_s, grace_s, idle_s
        self._gone_since: dict[Endpoint, float | None] = {}
        self._asked: dict[Endpoint, float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def gone(self, endpoints: Iterable[Endpoint]) -> bool:
        """Whether every endpoint has refused connections for the grace period (one
        not probed yet is not gone)."""
        now = time.monotonic()
        verdict = True
        with self._lock:
            for ep in endpoints:
                self._asked[ep] = now
                since = self._gone_since.setdefault(ep, None)
                verdict = verdict and since is not None and now - since >= self.grace_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sglang-hardened-peer-watch", daemon=True)
                self._thread.start()
        return verdict

    def _run(self) -> None:
        while True:
            with self._lock:
                stale = [ep for ep, t in self._asked.items() if time.monotonic() - t > self.idle_s]
                for ep in stale:
                    del self._asked[ep], self._gone_since[ep]
                watched = list(self._gone_since)
            for ep in watched:
                refused = refuses(ep)
                with self._lock:
                    if ep in self._gone_since:
                        self._gone_since[ep] = (self._gone_since[ep] or time.monotonic()) if refused else None
            time.sleep(self.interval_s)


_watch = PeerWatch()
_held: set[int] = set()  # rooms reported held past their timeout


def writers_gone(receiver) -> bool:
    """Seam, decode's deferred release once its timeout passed: may the room's pages go back?

    True when no prefill rank got the room's page indices, or every one that did
    is gone; otherwise the hold stays (logged once per room).
    """
    endpoints = [(str(i["rank_ip"]), int(i["rank_port"])) for i in (getattr(receiver, "bootstrap_infos", None) or ())]
    room, where = receiver.bootstrap_room, " ".join(f"{h}:{p}" for h, p in endpoints)
    if _watch.gone(endpoints):
        if room in _held:
            _held.discard(room)
            log.warning("sglang-hardened H5: room %s: prefill %s is gone; its held KV pages go back", room, where)
        return True
    if room not in _held:
        _held.add(room)
        log.warning("sglang-hardened H5: room %s: no drain ack by the release timeout; its KV pages stay held "
                    "until prefill %s acks or is gone (a stalled prefill still writes when it resumes)", room, where)
    return False
