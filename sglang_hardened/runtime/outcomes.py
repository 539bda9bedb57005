"""H4: a request prefill ends with an error is ended on decode at once, with prefill's error.

In PD mode the load balancer sends each request to prefill and decode
together, and a client behind sglang-router's mini-lb sees decode's answer.
When prefill rejects a request (an oversized prompt) or fails it, upstream
never tells decode: decode holds the request, and its pages, until its
waiting timeout (300 s), then answers 500. Here:

- prefill's HTTP process notes every request it ends with an abort, keyed by
  bootstrap room (`note_prefill_finish`), and its bootstrap server, which
  runs in that same process, serves the notes on OUTCOMES_ROUTE as a long
  poll (`add_routes`);
- each decode scheduler watches the bootstrap server of every prefill it
  meets (one thread per prefill, `fail_requests_prefill_ended`), aborts a
  queued request as soon as its room appears, through upstream's own
  `abort_request` (so upstream's release rules hold), and
- `prefill_verdict` (a seam in `prepare_abort`) makes decode end that request
  with prefill's status and message, not its own 500.

A new route and no wire change: upstream peers are untouched (a decode
watching an upstream prefill gets 404 and stops watching it).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from . import FAKE_BOOTSTRAP_HOST

OUTCOMES_ROUTE = "/hardened/outcomes"
# How long an outcome stays visible: a decode may meet a prefill's request
# (and start watching that prefill) after prefill has already rejected it.
RETAIN_S = 120.0
RETAIN_MAX = 8192
LONG_POLL_S = 5.0
RETRY_S = 1.0

log = logging.getLogger("sglang_hardened")


@dataclass(frozen=True)
class Outcome:
    """How prefill ended a request: what decode should answer for the same room."""

    seq: int
    room: int
    status: int
    message: str
    at: float


class OutcomeLog:
    """Prefill side: recent outcomes with sequence numbers, for long polls from decodes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[Outcome] = collections.deque(maxlen=RETAIN_MAX)
        self._seq = 0

    def add(self, room: int, status: int, message: str) -> None:
        with self._cond:
            self._seq += 1
            self._items.append(Outcome(self._seq, room, status, message, time.monotonic()))
            self._cond.notify_all()

    def since(self, seq: int, wait_s: float = 0.0) -> tuple[int, list[Outcome]]:
        """Outcomes after `seq` (all retained ones for seq < 0), waiting up to `wait_s` for one."""
        with self._cond:
            if wait_s and not (self._items and self._items[-1].seq > seq):
                self._cond.wait(wait_s)
            horizon = time.monotonic() - RETAIN_S
            return self._seq, [o for o in self._items if o.seq > seq and o.at >= horizon]


class Verdicts:
    """Decode side: prefill outcomes by room, bounded in size and age."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_room: collections.OrderedDict[int, Outcome] = collections.OrderedDict()

    def add(self, outcomes: list[Outcome]) -> None:
        with self._lock:
            for o in outcomes:
                self._by_room[o.room] = o
            horizon = time.monotonic() - RETAIN_S
            while self._by_room and (len(self._by_room) > RETAIN_MAX
                                     or next(iter(self._by_room.values())).at < horizon):
                self._by_room.popitem(last=False)

    def get(self, room: int | None) -> Outcome | None:
        if room is None or not self._by_room:
            return None
        with self._lock:
            return self._by_room.get(room)


# One of each per process: the prefill's HTTP process fills OUTCOMES, a decode
# scheduler process fills VERDICTS.
OUTCOMES = OutcomeLog()
VERDICTS = Verdicts()
_watched: set[str] = set()
_ended_rids: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborted once is enough
_watched_lock = threading.Lock()


# --- prefill side ------------------------------------------------------------

def note_prefill_finish(tokenizer_manager, obj, out: dict) -> None:
    """Seam in the tokenizer manager's response loop: note a prefill request ended by an abort."""
    reason = out.get("meta_info", {}).get("finish_reason")
    mode = getattr(getattr(tokenizer_manager, "disaggregation_mode", None), "value", None)
    room = getattr(obj, "bootstrap_room", None)
    if mode != "prefill" or not isinstance(reason, dict) or reason.get("type") != "abort":
        return
    if isinstance(room, int):
        OUTCOMES.add(room, int(reason.get("status_code") or 500), str(reason.get("message", "")))


def add_routes(app) -> None:
    """Seam where the bootstrap server sets up its routes: serve OUTCOMES as a long poll."""
    import asyncio

    from aiohttp import web

    async def outcomes(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            raise web.HTTPBadRequest(text=f"after must be an integer sequence number, not {request.query['after']!r}")
        seq, items = await asyncio.get_running_loop().run_in_executor(
            None, OUTCOMES.since, after, LONG_POLL_S)
        return web.json_response({"seq": seq, "outcomes": [[o.room, o.status, o.message] for o in items]})

    app.router.add_get(OUTCOMES_ROUTE, outcomes)


# --- decode side -------------------------------------------------------------

def _watch(addr: str) -> None:
    """Follow one prefill's outcomes for the life of this process."""
    seq = -1
    while True:
        url = f"http://{addr}{OUTCOMES_ROUTE}?after={seq}"
        try:
            with urllib.request.urlopen(url, timeout=LONG_POLL_S + 10) as resp:
                data = json.load(resp)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                log.warning("sglang-hardened H4: prefill %s is not hardened; its rejections reach "
                            "this decode only through its waiting timeout", addr)
                return
            time.sleep(RETRY_S)
            continue
        except (OSError, ValueError):
            time.sleep(RETRY_S)
            continue
        if data["seq"] < seq:  # the prefill restarted: its numbering did too
            seq = -1
            continue
        seq = data["seq"]
        received = time.monotonic()  # age counts on this host's clock, from arrival
        VERDICTS.add([Outcome(seq, int(room), int(status), str(message), received)
                      for room, status, message in data["outcomes"]])


def _ensure_watching(host: str | None, port: int | None) -> None:
    if not host or not port or host == FAKE_BOOTSTRAP_HOST:
        return
    addr = f"{host}:{port}"
    if addr in _watched:
        return
    with _watched_lock:
        if addr in _watched:
            return
        _watched.add(addr)
    threading.Thread(target=_watch, args=(addr,), name=f"hardened-h4-{addr}", daemon=True).start()


def fail_requests_prefill_ended(scheduler) -> None:
    """Seam in decode's queue processing: abort queued requests whose prefill already ended them."""
    queued = [d.req for d in scheduler.disagg_decode_prealloc_queue.queue]
    queued += [d.req for d in scheduler.disagg_decode_transfer_queue.queue]
    ended = []
    for req in queued:
        _ensure_watching(req.bootstrap_host, req.bootstrap_port)
        outcome = VERDICTS.get(req.bootstrap_room)
        if outcome is not None and not req.finished() and req.rid not in _ended_rids:
            ended.append((req, outcome))
    if not ended:
        return
    from sglang.srt.managers.io_struct import AbortReq

    for req, outcome in ended:
        _ended_rids[req.rid] = None
        while len(_ended_rids) > RETAIN_MAX:
            _ended_rids.popitem(last=False)
        log.info("sglang-hardened H4: prefill ended request %s (room %s) with %s: %s; ending it here",
                 req.rid, req.bootstrap_room, outcome.status, outcome.message)
        scheduler.abort_request(AbortReq(rid=req.rid))


def prefill_verdict(req, message: str, status_code):
    """Seam at the top of `prepare_abort`: prefill's status and message when it ended the request."""
    outcome = VERDICTS.get(getattr(req, "bootstrap_room", None))
    if outcome is None:
        return message, status_code
    return outcome.message, outcome.status
