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
  bootstrapped from and its queued requests name (one thread per prefill, at
  most WATCHERS_MAX, each stopping when no request has named its prefill for
  WATCH_IDLE_S; `fail_requests_prefill_ended`), aborts a queued request as
  soon as its room appears, through upstream's own `abort_request` (so
  upstream's release rules hold), and
- `prefill_verdict` (a seam in `prepare_abort`) makes decode end that request
  with prefill's status and message, not its own 500.

A new route and no wire change: upstream peers are untouched (a decode
watching an upstream prefill gets 404 and asks again after RECHECK_S, so a
prefill upgraded in place is noticed). H4 is about how soon a client hears,
not about which pages are safe: a prefill decode does not follow reaches it
through upstream's waiting timeout, as without H4.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Container
from dataclasses import dataclass

from ..common.knobs import BOOTSTRAP_TOKEN
from . import bootstrap_auth, input_limits, metrics
from .coverage import SHORTFALL
from .peer_json import READ_ERRORS, get_json, is_int
from .warmup import FAKE_BOOTSTRAP_HOST

OUTCOMES_ROUTE = "/hardened/outcomes"
# How long an outcome stays visible: a decode may meet a prefill's request
# (and start watching that prefill) after prefill has already rejected it.
RETAIN_S = 120.0
RETAIN_MAX = 8192
LONG_POLL_S = 5.0
RETRY_S = 1.0
POLLS_MAX = 256  # long polls a bootstrap server holds at once; more get 503
# A reply waits until its first outcome is this old, so a burst of outcomes is one reply to each
# follower, not one reply per outcome per follower: the replies prefill's HTTP process serves are
# at most about followers / COALESCE_S a second, whatever rate of rejections a client sets off.
COALESCE_S = 0.05
# Reasons that carry only numbers besides their fixed text ({name}: a number), passed on as they
# are wherever prefill's message holds one: upstream's input limit, H3's sender refusal (inside
# prefill's "Prefill transfer failed for request ... rid=..." line, which quotes the rid).
SAFE_TEMPLATES = (
    "Input length ({n} tokens) exceeds the maximum allowed length ({n} tokens). "
    "Use a shorter input or enable --allow-auto-truncate.",
    SHORTFALL,
)

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
    """Prefill side: recent outcomes with sequence numbers, for long polls from decodes.

    Filled from the tokenizer manager's thread, read by the bootstrap server's event
    loop: a poll waits on an asyncio event that ``add`` sets from its own thread, so
    no poll holds a thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[Outcome] = collections.deque()
        self._seq = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._catch_up: tuple[int, float, bytes] | None = None  # (seq, good until, reply body)

    def add(self, room: int, status: int, message: str) -> None:
        """Note how prefill ended ``room``: its status (a 4xx/5xx, else 500) and ``note(status, message)``."""
        status = status if 400 <= status <= 599 else 500
        now = time.monotonic()
        with self._lock:
            self._seq += 1
            self._items.append(Outcome(self._seq, room, status, note(status, message), now))
            while self._items and (len(self._items) > RETAIN_MAX or self._items[0].at < now - RETAIN_S):
                self._items.popleft()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that poll's loop has closed
                pass

    def since(self, seq: int) -> tuple[int, list[Outcome]]:
        """The last sequence number, and the outcomes after `seq` (all retained ones for seq < 0)."""
        with self._lock:
            horizon = time.monotonic() - RETAIN_S
            return self._seq, [o for o in self._items if o.seq > seq and o.at >= horizon]

    async def wait_since(self, seq: int, wait_s: float) -> tuple[int, list[Outcome]]:
        """``since(seq)``, waiting up to ``wait_s`` for an outcome when there is none yet; a reply
        whose first outcome is younger than COALESCE_S waits until it is that old, so the rest
        of a burst goes in the same reply however fast outcomes come."""
        event = asyncio.Event()
        key = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.add(key)
        try:
            current, items = self.since(seq)  # after registering: an add in between sets the event
            if not items:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), wait_s)
                current, items = self.since(seq)
        finally:
            with self._lock:
                self._waiters.discard(key)  # before lingering: the rest of the burst wakes it no more
        if items and (linger := items[0].at + COALESCE_S - time.monotonic()) > 0:
            await asyncio.sleep(linger)
            current, items = self.since(seq)
        return current, items


    async def reply(self, seq: int, wait_s: float) -> bytes:
        """The route's reply to a poll after ``seq``: a catch-up when it has seen nothing yet
        and outcomes are retained, else ``wait_since``."""
        with self._lock:
            retained = bool(self._items)
        if seq < 0 and retained:
            return await self._catch_up_reply()
        return reply_body(*await self.wait_since(seq, wait_s))

    async def _catch_up_reply(self) -> bytes:
        """Every retained outcome. It waits COALESCE_S, as a reply to a burst does, and one
        body serves every catch-up until an outcome is added or the oldest expires, so a loop
        of catch-ups (restarted decodes, or anyone who reaches the port without a token)
        costs prefill's HTTP process no listing of up to RETAIN_MAX outcomes per poll."""
        await asyncio.sleep(COALESCE_S)
        now = time.monotonic()
        with self._lock:
            cached = self._catch_up
            if cached and cached[0] == self._seq and now < cached[1]:
                return cached[2]
        seq, items = self.since(-1)
        body = reply_body(seq, items)
        with self._lock:
            self._catch_up = (seq, (items[0].at if items else now) + RETAIN_S, body)
        return body


def reply_body(seq: int, items: list[Outcome]) -> bytes:
    """A poll's reply as the route sends it (``parse_reply`` reads it back)."""
    return json.dumps({"seq": seq, "outcomes": [[o.room, o.status, o.message] for o in items]}).encode()


def _numbers_only(template: str) -> re.Pattern[str]:
    """A template's fixed text, each field a run of digits."""
    return re.compile("".join(re.escape(text) + (r"\d+" if field is not None else "")
                              for text, field, _, _ in string.Formatter().parse(template)))


_SAFE_REASONS = tuple(map(_numbers_only, SAFE_TEMPLATES))


def note(status: int, message: str) -> str:
    """What decode may tell the client for prefill: the first of SAFE_TEMPLATES prefill's message
    holds, else a fixed reason. Any decode that reaches the bootstrap port reads the notes, so
    none may carry request content (a grammar error quotes its schema; some messages quote the
    rid)."""
    for reason in _SAFE_REASONS:
        if found := reason.search(message):
            return found.group(0)
    return f"sglang-hardened H4: prefill ended this request with status {status}"


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
_ended_rids: collections.OrderedDict[str, None] = collections.OrderedDict()  # aborted once is enough
_watched_lock = threading.Lock()


# --- prefill side ------------------------------------------------------------

def note_prefill_finish(tokenizer_manager, obj, out: dict) -> None:
    """Seam in the tokenizer manager's response loop: note a prefill request ended by an abort,
    and count the scheduler's admission refusal (over its input limit: the smaller of pool and
    context) on prefill and on a server outside PD. Not on decode, where that refusal reads the
    same as H4 ending a request on prefill's word (counted as H4 ``prefill_ended``)."""
    reason = out.get("meta_info", {}).get("finish_reason")
    role = input_limits.role_of(tokenizer_manager)
    room = getattr(obj, "bootstrap_room", None)
    if role == "decode" or not isinstance(reason, dict) or reason.get("type") != "abort":
        return
    status, message = int(reason.get("status_code") or 500), str(reason.get("message", ""))
    if status == 400 and _SAFE_REASONS[0].search(message):  # refused at admission: nothing bootstrapped
        metrics.refused("H1", "prefill" if role == "prefill" else "api", "input_too_long")
    if role == "prefill" and isinstance(room, int):
        OUTCOMES.add(room, status, message)


def add_routes(app) -> None:
    """Seam where the bootstrap server sets up its routes: serve OUTCOMES as a long poll
    (at most POLLS_MAX at once; behind bootstrap_auth's token when prefill has one)."""
    from aiohttp import web

    polls = 0

    async def outcomes(request: web.Request) -> web.Response:
        nonlocal polls
        if not bootstrap_auth.token_ok(request.headers):
            raise web.HTTPForbidden(text=bootstrap_auth.refused_text(OUTCOMES_ROUTE))
        try:
            after = int(request.query.get("after", "-1"))
        except ValueError:
            raise web.HTTPBadRequest(text="after must be an integer sequence number") from None
        if polls >= POLLS_MAX:
            raise web.HTTPServiceUnavailable(text=f"more than {POLLS_MAX} outcome polls at once")
        polls += 1
        try:
            body = await OUTCOMES.reply(after, LONG_POLL_S)
        finally:
            polls -= 1
        return web.Response(body=body, content_type="application/json")

    app.router.add_get(OUTCOMES_ROUTE, outcomes)


# --- decode side -------------------------------------------------------------

WATCHERS_MAX = 64  # prefills one decode scheduler follows at once
WATCH_IDLE_S = 300.0  # a watcher no queued request has needed for this long stops
RECHECK_S = 60.0  # a prefill that answered 404 (not hardened) is asked again after this
REPLY_MAX = 16 << 20  # bytes of one long-poll reply decode reads (RETAIN_MAX outcomes and more)
MESSAGE_MAX = 1024  # characters of a prefill's message decode keeps


@dataclass
class _Watcher:
    wanted_at: float  # when a queued request last named this prefill
    said: bool = False  # whether a bad reply was logged (once per watcher)


_watchers: dict[str, _Watcher] = {}
_not_hardened: collections.OrderedDict[str, float] = collections.OrderedDict()  # addr: when it answered 404
_full_said = False


def parse_reply(data: object) -> tuple[int, list[tuple[int, int, str]]]:
    """A long-poll reply as (seq, [(room, status, message)]); ValueError names what is wrong."""
    if not isinstance(data, dict) or not is_int(seq := data.get("seq")) or seq < 0:
        raise ValueError("reply has no non-negative integer seq")
    items = data.get("outcomes")
    if not isinstance(items, list):
        raise ValueError("reply has no outcomes list")
    parsed = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and is_int(item[0]) and is_int(item[1])
                and 400 <= item[1] <= 599 and isinstance(item[2], str)):
            raise ValueError("an outcome is not [room, 4xx/5xx status, message]")
        parsed.append((item[0], item[1], item[2][:MESSAGE_MAX]))
    return seq, parsed


def _watch(addr: str, watcher: _Watcher) -> None:
    """Follow one prefill's outcomes while queued requests keep naming it."""
    seq = -1
    try:
        while time.monotonic() - watcher.wanted_at < WATCH_IDLE_S:
            poll = urllib.request.Request(f"http://{addr}{OUTCOMES_ROUTE}?after={seq}", headers=bootstrap_auth.headers())
            try:
                new_seq, items = parse_reply(get_json(poll, LONG_POLL_S + 10, REPLY_MAX))
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    metrics.polled("unhardened")
                    log.warning("sglang-hardened H4: prefill %s is not hardened; its rejections reach this decode "
                                "only through its waiting timeout (asked again in %.0f s)", addr, RECHECK_S)
                    with _watched_lock:
                        _not_hardened[addr] = time.monotonic()
                        while len(_not_hardened) > WATCHERS_MAX:
                            _not_hardened.popitem(last=False)
                    return
                metrics.polled("unreadable")
                _bad_reply(addr, watcher, f"HTTP {exc.code}" + (f": set {BOOTSTRAP_TOKEN.name} alike on both roles" if exc.code == 403 else ""))
                continue
            except READ_ERRORS as exc:
                metrics.polled("unreadable")
                _bad_reply(addr, watcher, f"{type(exc).__name__}: {exc}"[:200])
                continue
            if new_seq < seq:  # the prefill restarted: its numbering did too
                seq = -1
                continue
            metrics.polled("ok")
            seq = new_seq
            received = time.monotonic()  # age counts on this host's clock, from arrival
            VERDICTS.add([Outcome(seq, room, status, message, received) for room, status, message in items])
    finally:
        with _watched_lock:
            _watchers.pop(addr, None)
        metrics.following(-1)


def _bad_reply(addr: str, watcher: _Watcher, reason: str) -> None:
    """Log a failed poll once per watcher, then wait before the next."""
    if not watcher.said:
        watcher.said = True
        log.warning("sglang-hardened H4: cannot read outcomes from prefill %s (%s); retrying every %.0f s",
                    addr, reason, RETRY_S)
    time.sleep(RETRY_S)


def _ensure_watching(addr: str, bootstrapped: Container[str], now: float | None = None) -> None:
    """Follow the prefill at ``addr`` (host:port, an IPv6 host in brackets), if decode
    bootstrapped from it and may follow one more. A prefill already followed only has its
    watcher's time renewed, without the lock: the scan calls this every loop iteration, and a
    watcher that stops in between (its idle time passed) is started again on the next one."""
    global _full_said
    if addr not in bootstrapped:  # only prefills that answered upstream's own bootstrap
        return
    now = time.monotonic() if now is None else now
    if (watcher := _watchers.get(addr)) is not None:
        watcher.wanted_at = now
        return
    with _watched_lock:
        if (watcher := _watchers.get(addr)) is not None:
            watcher.wanted_at = now
            return
        if now - _not_hardened.get(addr, -RECHECK_S) < RECHECK_S:
            return
        if len(_watchers) >= WATCHERS_MAX:
            if not _full_said:
                _full_said = True
                log.warning("sglang-hardened H4: already following %d prefills; %s and others reach this decode's "
                            "requests only through its waiting timeout", WATCHERS_MAX, addr)
            return
        watcher = _watchers[addr] = _Watcher(now)
    metrics.following(+1)
    threading.Thread(target=_watch, args=(addr, watcher), name=f"hardened-h4-{addr}", daemon=True).start()


def _bootstrap_addr(req) -> str | None:
    """The prefill's address as decode's queue keys it (upstream's own form: IPv6 bracketed), or
    None for a request with none (warm-up's fake one included). Kept on the request: the scan
    asks for it every loop iteration while the request is queued, and it never changes."""
    try:
        return req.hardened_h4_addr
    except AttributeError:
        pass
    addr = None
    if req.bootstrap_host and req.bootstrap_port and req.bootstrap_host != FAKE_BOOTSTRAP_HOST:
        from sglang.srt.utils.network import NetworkAddress

        addr = NetworkAddress(req.bootstrap_host, req.bootstrap_port).to_host_port_str()
    req.hardened_h4_addr = addr
    return addr


def fail_requests_prefill_ended(scheduler) -> None:
    """Seam in decode's queue processing, every loop iteration: follow the prefills the queued
    requests name, and abort those whose prefill already ended them. Each prefill is renewed
    once per iteration however many requests name it; the verdicts are looked up only when
    some have arrived."""
    prealloc, transfer = scheduler.disagg_decode_prealloc_queue.queue, scheduler.disagg_decode_transfer_queue.queue
    if not prealloc and not transfer:
        return
    queued = [d.req for d in prealloc] + [d.req for d in transfer]
    bootstrapped = scheduler.disagg_decode_prealloc_queue.kv_manager.prefill_info_table
    now = time.monotonic()
    for addr in {_bootstrap_addr(req) for req in queued} - {None}:
        _ensure_watching(addr, bootstrapped, now)
    ended = [(req, outcome) for req in queued if (outcome := VERDICTS.get(req.bootstrap_room)) is not None
             and not req.finished() and req.rid not in _ended_rids]
    if not ended:
        return
    from sglang.srt.managers.io_struct import AbortReq

    for req, outcome in ended:
        _ended_rids[req.rid] = None
        while len(_ended_rids) > RETAIN_MAX:
            _ended_rids.popitem(last=False)
        log.info("sglang-hardened H4: prefill ended request %s (room %s) with %s: %s; ending it here",
                 req.rid, req.bootstrap_room, outcome.status, outcome.message)
        metrics.refused("H4", "decode", "prefill_ended")
        scheduler.abort_request(AbortReq(rid=req.rid))


def prefill_verdict(req, message: str, status_code):
    """Seam at the top of `prepare_abort`: prefill's status and message when it ended the request."""
    outcome = VERDICTS.get(getattr(req, "bootstrap_room", None))
    if outcome is None:
        return message, status_code
    return outcome.message, outcome.status
