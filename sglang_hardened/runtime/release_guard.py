"""H5: a held decode page goes back only when no write into it can still land.

Decode holds a failed request's pages until every prefill rank acks that its
writes drained, or until SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
passes; upstream then releases anyway. The timeout is a proof only for a write
already submitted (H6 bounds one call well under it; 0.5.23 withholds the ack
of a failed send and leans on exactly that). It proves nothing about a prefill
that is stalled (stopped, frozen, swapping): that one submits its write when it
resumes, into pages another request owns by then.

So past the timeout a hold ends only once every rank that got the room's page
indices is, at its rank endpoint (the ZMQ socket bound by the same process as
its transfer worker):
- gone: it refuses TCP connections for ``GONE_GRACE_S`` (what a dead sender
  already put on the wire has been applied), or
- running: its ZMQ I/O thread has greeted every probe for a full release
  timeout, so any write it had pending was submitted and, bounded by H6,
  done. A NIXL write has no such bound: one prefill gave up on can still be
  in flight after a timeout of running, over UCX TCP into a peer that was
  stalled. Where the build's NIXL prefill acks a failed room only once the
  writes it gave up on have settled (`nixl_drain`), a NIXL hold ends at that
  ack or when prefill is gone; elsewhere it keeps this rule, as its prefill
  may never ack.
A stalled process still accepts (the kernel completes the handshake) but sends
no greeting; an unreachable one neither: both keep the hold, logged once per
room, until the rank acks or one of the above holds.

Probes run on one daemon thread, never on the scheduler's: the seam reads the
last verdict.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from . import metrics
from .release_timeout import process_release_timeout_s

PROBE_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 1.0
GONE_GRACE_S = 1.0
ZMTP_SIGNATURE_START = 0xFF  # the first byte every ZMQ peer sends on a new connection

Endpoint = tuple[str, int]
GONE, RUNNING, SILENT = "gone", "running", "silent"

log = logging.getLogger("sglang_hardened")


def probe(endpoint: Endpoint, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """GONE if the endpoint refuses a TCP connection, RUNNING if a ZMQ peer greets it,
    SILENT otherwise (accepted without a greeting, timed out, unreachable)."""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s) as conn:
            return RUNNING if conn.recv(1)[:1] == bytes([ZMTP_SIGNATURE_START]) else SILENT
    except ConnectionRefusedError:
        return GONE
    except OSError:
        return SILENT


@dataclass
class _Seen:
    state: str = SILENT
    since: float = 0.0  # when the endpoint entered ``state``
    asked: float = 0.0  # when a hold last asked about it


class PeerWatch:
    """Probes the endpoints asked about in the background; an endpoint nobody asked
    about for ``idle_s`` is no longer probed."""

    def __init__(self, interval_s: float = PROBE_INTERVAL_S, grace_s: float = GONE_GRACE_S,
                 idle_s: float = 10.0) -> None:
        self.interval_s, self.grace_s, self.idle_s = interval_s, grace_s, idle_s
        self._seen: dict[Endpoint, _Seen] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def settled(self, endpoints: Iterable[Endpoint], running_for_s: float) -> bool:
        """Whether every endpoint is gone (for the grace period) or running (for
        ``running_for_s``); one not probed yet is neither."""
        now = time.monotonic()
        verdict = True
        with self._lock:
            for ep in endpoints:
                seen = self._seen.setdefault(ep, _Seen(since=now))
                seen.asked = now
                need = {GONE: self.grace_s, RUNNING: running_for_s}.get(seen.state)
                verdict = verdict and need is not None and now - seen.since >= need
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sglang-hardened-peer-watch", daemon=True)
                self._thread.start()
        return verdict

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                for ep in [ep for ep, seen in self._seen.items() if now - seen.asked > self.idle_s]:
                    del self._seen[ep]
                watched = list(self._seen)
            for ep in watched:
                state = probe(ep)
                with self._lock:
                    seen = self._seen.get(ep)
                    if seen is not None and seen.state != state:
                        seen.state, seen.since = state, time.monotonic()
            time.sleep(self.interval_s)


_watch = PeerWatch()
# Rooms reported held past their timeout, and when the seam last asked about each: a hold its
# drain ack ends is never asked about again (upstream frees the pages without the seam), so a
# room not asked about for FORGET_S is forgotten; the scheduler asks about a held room on every
# pass of its loop (at least once a second), so only ended holds are ever that quiet.
_held: dict[int, float] = {}
FORGET_S = 60.0
DRAIN_ALIAS = "hardened_nixl_drain"  # what a backend's module imports nixl_drain as (the seam rule's one alias)


def _running_proves_drained(receiver) -> bool:
    """Whether a prefill running for a release timeout proves its writes for this receiver done:
    not where the backend's module acks only once they settled (NIXL with `nixl_drain`)."""
    return not hasattr(sys.modules.get(type(receiver).__module__), DRAIN_ALIAS)


def writers_settled(receiver) -> bool:
    """Seam, decode's deferred release once its timeout passed: may the room's pages go back?

    True when no prefill rank got the room's page indices, or every one that did
    is gone or (bar NIXL with `nixl_drain`) has been running, not stalled, for a release timeout;
    otherwise the hold stays (logged once per room).
    """
    endpoints = [(str(i["rank_ip"]), int(i["rank_port"])) for i in (getattr(receiver, "bootstrap_infos", None) or ())]
    room, where = receiver.bootstrap_room, " ".join(f"{h}:{p}" for h, p in endpoints)
    now = time.monotonic()
    for ended in [r for r, asked in _held.items() if now - asked > FORGET_S]:
        del _held[ended]  # no longer asked about: its drain ack came, and upstream released it
        metrics.hold_ended("decode", "drain_ack")
    bounded = _running_proves_drained(receiver)
    running_for_s = process_release_timeout_s() if bounded else float("inf")
    if _watch.settled(endpoints, running_for_s=running_for_s):
        if _held.pop(room, None) is not None:
            metrics.hold_ended("decode", "prefill_gone")
            log.warning("sglang-hardened H5: room %s: prefill %s is gone or running again; its held KV pages go back",
                        room, where)
        return True
    if room not in _held:
        metrics.hold_started("decode")
        log.warning("sglang-hardened H5: room %s: no drain ack by the release timeout; its KV pages stay held until "
                    "prefill %s %s (a stalled prefill still writes when it resumes)", room, where,
                    "acks, is gone, or has run for another timeout" if bounded else "acks or is gone")
    _held[room] = now
    return False
