"""H3's and H4's bookkeeping on their own; tests/e2e/test_oversized.py shows them in real servers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from sglang_hardened.common.knobs import BOOTSTRAP_TOKEN
from sglang_hardened.runtime import bootstrap_auth, coverage, outcomes
from sglang_hardened.runtime.page_tags import seams
from sglang_hardened.runtime.page_tags.rows import DecodePageTags
from sglang_hardened.runtime.coverage import SHORTFALL
from sglang_hardened.runtime.warmup import FAKE_BOOTSTRAP_HOST
from sglang_hardened.runtime.outcomes import OutcomeLog, Verdicts
from tests.harness import eventually
from tests.unit.test_page_tags_seams import ROOM, decode_req

WAIT_S = 30.0  # a long poll's deadline, far beyond the outcome's 0.2 s


TOO_LONG = ("Input length (601 tokens) exceeds the maximum allowed length (250 tokens). "
            "Use a shorter input or enable --allow-auto-truncate.")


async def until(pred: Callable[[], bool]) -> None:
    """``eventually`` for a test on the event loop that changes the state: waits without blocking
    it (and fails, after WAIT_S, by timing out)."""
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), WAIT_S)


def test_outcome_log_long_poll_wakes_on_a_new_outcome():
    log = OutcomeLog()
    assert log.since(-1) == (0, [])
    threading.Timer(0.2, log.add, args=(7, 400, TOO_LONG)).start()
    start = time.monotonic()
    seq, items = asyncio.run(log.wait_since(0, WAIT_S))
    assert time.monotonic() - start < WAIT_S / 2, "the poll returns when an outcome arrives, not at its deadline"
    assert seq == 1 and [(o.room, o.status, o.message) for o in items] == [(7, 400, TOO_LONG)]
    assert log.since(1)[1] == [], "an outcome is delivered once to a poller that keeps its place"


@pytest.mark.parametrize("status, message, noted", [
    (400, TOO_LONG, (400, TOO_LONG)),  # numbers only besides upstream's fixed text: kept
    (400, 'Failed to compile JSON schema {"tenant_secret": "..."}', (400, "sglang-hardened H4: prefill ended this "
                                                                          "request with status 400")),
    (500, "Request lb-1234 exceeds the maximum number of tokens: 601 > 250", (500, "sglang-hardened H4: prefill ended "
                                                                                  "this request with status 500")),
    (200, "", (500, "sglang-hardened H4: prefill ended this request with status 500")),  # an abort is an error
    # finding 21.11: H3's sender refusal inside prefill's line, which quotes the rid: only the refusal
    (500, "Prefill transfer failed for request rank=0 req.rid='tenant-secret' req.bootstrap_room=7 with exception "
          "KVTransferError(bootstrap_room=7): " + SHORTFALL.format(room=7, expects=38, sends=32),
     (500, SHORTFALL.format(room=7, expects=38, sends=32))),
])
def test_notes_carry_no_request_content(status, message, noted):
    """Finding (review): every aborted request's message was served to anyone on the bootstrap
    port, whatever it quoted of the request."""
    log = OutcomeLog()
    log.add(1, status, message)
    assert [(o.status, o.message) for o in log.since(-1)[1]] == [noted]


def test_outcomes_are_evicted_by_count_and_age_as_they_are_added(monkeypatch):
    monkeypatch.setattr(outcomes, "RETAIN_MAX", 3)
    log = OutcomeLog()
    for room in range(5):
        log.add(room, 400, TOO_LONG)
    assert len(log._items) == 3 and [o.room for o in log.since(-1)[1]] == [2, 3, 4]
    monkeypatch.setattr(outcomes, "RETAIN_S", -1.0)  # and by age: every earlier one is too old now
    log.add(9, 400, TOO_LONG)
    assert len(log._items) == 0


def test_outcome_log_forgets_what_is_older_than_its_window(monkeypatch):
    log = OutcomeLog()
    log.add(1, 400, "old")
    monkeypatch.setattr(outcomes, "RETAIN_S", -1.0)
    assert log.since(-1)[1] == []


def test_verdicts_are_bounded_and_keyed_by_room(monkeypatch):
    monkeypatch.setattr(outcomes, "RETAIN_MAX", 3)
    verdicts = Verdicts()
    verdicts.add([outcomes.Outcome(0, room, 400, f"m{room}", time.monotonic()) for room in range(5)])
    assert verdicts.get(0) is None and verdicts.get(1) is None
    assert verdicts.get(4).message == "m4" and verdicts.get(None) is None


def test_verdicts_older_than_the_window_are_forgotten():
    verdicts = Verdicts()
    verdicts.add([outcomes.Outcome(0, 1, 400, "old", time.monotonic() - outcomes.RETAIN_S - 1)])
    assert verdicts.get(1) is None


def _route_client(monkeypatch, log: OutcomeLog | None = None):
    """The bootstrap server's route on a real aiohttp server on loopback, serving ``log``."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    monkeypatch.setattr(outcomes, "OUTCOMES", log or OutcomeLog())
    app = web.Application()
    outcomes.add_routes(app)
    return TestClient(TestServer(app))


def test_outcomes_route_serves_the_log_and_refuses_a_malformed_position(monkeypatch):
    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)
    log = OutcomeLog()
    log.add(7, 400, TOO_LONG)

    async def run():
        async with _route_client(monkeypatch, log) as client:
            ok = await client.get(outcomes.OUTCOMES_ROUTE, params={"after": "-1"})
            bad = await client.get(outcomes.OUTCOMES_ROUTE, params={"after": "x"})
            return ok.status, await ok.json(), bad.status, await bad.text()

    status, body, bad_status, bad_text = asyncio.run(run())
    assert status == 200 and body == {"seq": 1, "outcomes": [[7, 400, TOO_LONG]]}
    assert bad_status == 400 and "after must be an integer" in bad_text


def test_long_polls_hold_no_thread_and_are_capped(monkeypatch):
    """Finding (review): each poll held an executor thread for its 5 s, with no cap. The polls wait
    until an outcome ends them, not for a deadline: on a slow host early ones would end before
    the last one arrived."""
    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)
    monkeypatch.setattr(outcomes, "POLLS_MAX", 20)
    monkeypatch.setattr(outcomes, "LONG_POLL_S", WAIT_S)
    log = OutcomeLog()

    async def run():
        async with _route_client(monkeypatch, log) as client:
            before = threading.active_count()
            polls = [asyncio.ensure_future(client.get(outcomes.OUTCOMES_ROUTE)) for _ in range(20)]
            await until(lambda: len(log._waiters) == 20)
            during = threading.active_count()
            over = await client.get(outcomes.OUTCOMES_ROUTE)
            log.add(7, 400, TOO_LONG)
            answers = await asyncio.gather(*polls)
            return before, during, over.status, [a.status for a in answers]

    before, during, over, statuses = asyncio.run(run())
    assert during == before, "twenty waiting polls, no thread more"
    assert over == 503 and statuses == [200] * 20


@pytest.mark.parametrize("outcomes_sent, spacing_s", [(20, 0.01), (400, 0.0005)])
def test_a_burst_of_outcomes_reaches_a_follower_in_a_few_replies_not_one_each(monkeypatch, outcomes_sent, spacing_s):
    """Finding (benchmarks/bench_outcomes.py): every outcome woke every waiting poll, so each
    follower made one request per outcome: prefill's HTTP process served followers x outcomes
    replies (44 % of a core at 32 followers and 50 outcomes/s), a rate a client sending
    oversized prompts sets. A reply now waits until its first outcome is COALESCE_S old, also
    when the poll found it waiting (outcomes faster than a round trip: the tight burst)."""
    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)
    log = OutcomeLog()

    def burst() -> float:
        began = time.monotonic()
        for room in range(outcomes_sent):  # from another thread, as prefill's tokenizer adds them
            log.add(room, 400, TOO_LONG)
            time.sleep(spacing_s)
        return time.monotonic() - began

    async def run():
        async with _route_client(monkeypatch, log) as client:
            async def follow() -> int:
                seq, seen, replies = -1, 0, 0
                while seen < outcomes_sent:
                    body = await (await client.get(outcomes.OUTCOMES_ROUTE, params={"after": str(seq)})).json()
                    seq, seen, replies = body["seq"], seen + len(body["outcomes"]), replies + 1
                return replies

            followers = [asyncio.ensure_future(follow()) for _ in range(4)]
            await until(lambda: len(log._waiters) == 4)  # every follower waits in its first poll
            took = await asyncio.to_thread(burst)
            return took, await asyncio.wait_for(asyncio.gather(*followers), 10)  # a lost outcome fails, not hangs

    took, replies = asyncio.run(run())
    bound = took / outcomes.COALESCE_S + 2  # one reply per coalescing window, and the edges
    assert all(r <= bound for r in replies), f"{replies} replies for {outcomes_sent} outcomes in {took:.3f} s"


def test_with_a_token_only_a_decode_that_sends_it_reads_the_outcomes(monkeypatch):
    monkeypatch.setenv(BOOTSTRAP_TOKEN.name, "s3cret")
    log = OutcomeLog()
    log.add(7, 400, TOO_LONG)

    async def run():
        async with _route_client(monkeypatch, log) as client:
            statuses = []
            for headers in ({}, {bootstrap_auth.TOKEN_HEADER: "guess"}, {bootstrap_auth.TOKEN_HEADER: "s3cret"}):
                statuses.append((await client.get(outcomes.OUTCOMES_ROUTE, headers=headers)).status)
            return statuses

    assert asyncio.run(run()) == [403, 403, 200]
    assert bootstrap_auth.headers() == {bootstrap_auth.TOKEN_HEADER: "s3cret"}  # what decode's watchers send


def _prefill_manager(mode="prefill"):
    return SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode))


@pytest.mark.parametrize("mode, reason, noted", [
    ("prefill", {"type": "abort", "status_code": 400, "message": "too long"}, True),
    ("prefill", {"type": "length", "length": 8}, False),  # a success is not an outcome to push
    ("decode", {"type": "abort", "status_code": 400, "message": "too long"}, False),
])
def test_only_prefill_aborts_are_noted(monkeypatch, mode, reason, noted):
    monkeypatch.setattr(outcomes, "OUTCOMES", OutcomeLog())
    obj = SimpleNamespace(bootstrap_room=42)
    outcomes.note_prefill_finish(_prefill_manager(mode), obj, {"meta_info": {"finish_reason": reason}})
    items = outcomes.OUTCOMES.since(-1)[1]
    assert [(o.room, o.status) for o in items] == ([(42, 400)] if noted else [])


def test_decode_answers_with_prefills_status_and_message_for_that_room_only(monkeypatch):
    verdicts = Verdicts()
    verdicts.add([outcomes.Outcome(0, 9, 400, "Input length (601 tokens) exceeds ...", time.monotonic())])
    monkeypatch.setattr(outcomes, "VERDICTS", verdicts)
    assert outcomes.prefill_verdict(SimpleNamespace(bootstrap_room=9), "transfer failed", 500) == (
        "Input length (601 tokens) exceeds ...", 400)
    assert outcomes.prefill_verdict(SimpleNamespace(bootstrap_room=8), "transfer failed", 500) == (
        "transfer failed", 500)


def _req(tokens: int, host: str = "127.0.0.1"):
    return SimpleNamespace(origin_input_ids=[1] * tokens, rid="r1", bootstrap_room=5, bootstrap_host=host)


def test_stamp_then_check_passes_only_for_the_same_prompt_length():
    row = [5, 0, 0, 0, 0, 0, 0, 0]
    coverage.stamp(row, _req(506))
    assert coverage.uncovered_reason(_req(506), row) is None
    reason = coverage.uncovered_reason(_req(509), row)
    assert "prefill computed KV for 506 prompt tokens" in reason and "as 509 tokens" in reason


def test_no_stamp_is_a_refusal_but_warm_up_requests_carry_none():
    row = [5, 0, 0, 0, 0, 0, 0, 0]  # what an unhardened prefill sends
    assert "did not state how many prompt tokens" in coverage.uncovered_reason(_req(10), row)
    assert coverage.uncovered_reason(_req(10, host=FAKE_BOOTSTRAP_HOST), row) is None


def test_a_refused_request_s_page_tag_allocation_is_forgotten(monkeypatch):
    """Upstream frees a request H3 aborts through ``_release_request``, which H8's release seam
    (in ``_do_release``) never sees: before, each refusal left its room's epoch and page index
    in decode's tags for the process's life."""
    monkeypatch.setattr(coverage, "abort_before_decode", lambda _req, _reason: None)
    tags = DecodePageTags(16)
    dreq = decode_req(tags, prompt=10)
    dreq.req.rid = "r1"
    seams.allocate(dreq, [2, 3, 4])
    assert coverage.refuse_uncovered(SimpleNamespace(gloo_group=None), dreq, [ROOM, 0, 0])
    assert ROOM not in tags.expected and ROOM not in tags._allocated


@pytest.mark.parametrize("last, stop, dst, short", [
    (True, 32, 38, True),    # decode allocated 6 more pages than prefill sends
    (True, 38, 38, False),
    (True, 38, 32, False),   # the other direction is upstream's own trim
    (False, 16, 38, False),  # not the last chunk: more pages will come
])
def test_sender_shortfall_only_on_a_short_last_chunk(last, stop, dst, short):
    chunk = SimpleNamespace(is_last_chunk=last, index_slice=slice(0, stop), room=3)
    reason = coverage.sender_shortfall(chunk, dst)
    assert (reason is not None) == short
    if short:
        assert f"decode expects {dst} pages but prefill sends {stop}" in reason


def test_the_senders_refusal_tells_decode_why():
    """Finding 21.11: the refusal went out through upstream's status message with Mooncake's
    switch for a reason off, and decode's client read that prefill "might be dead". The manager
    stands in for MooncakeKVManager (0.5.20 on), whose conclude_failure sends what the switch says."""
    sent = []
    manager = SimpleNamespace(kv_status_msg_carries_reason=False)
    manager.conclude_failure = lambda bootstrap_room, failure_reason: sent.append(
        (bootstrap_room, failure_reason if manager.kv_status_msg_carries_reason else None))
    chunk = SimpleNamespace(is_last_chunk=True, index_slice=slice(0, 32), room=3)
    assert coverage.fail_short_transfer(manager, chunk, SimpleNamespace(dst_kv_indices=range(38)))
    assert sent == [(3, SHORTFALL.format(room=3, expects=38, sends=32))]


# --- decode's watchers (review findings: one thread per address for ever, started from any
# address a request names, stopped for good by one 404, killed silently by a malformed reply)

@pytest.fixture
def prefill_stand_in(http_stand_in):
    """A prefill's outcomes route from a script of (status, body) replies, the last repeating;
    returns its address and the paths asked."""
    def serve(*replies: tuple[int, bytes]) -> tuple[str, list[str]]:
        script, asked = list(replies), []

        def answer(path: str) -> tuple[int, bytes]:
            asked.append(path)
            return script.pop(0) if len(script) > 1 else script[0]

        return http_stand_in(answer), asked

    return serve


@pytest.fixture
def watchers(monkeypatch):
    """A decode with no watchers, quick retries, and its own verdicts."""
    monkeypatch.setattr(outcomes, "_watchers", {})
    monkeypatch.setattr(outcomes, "_not_hardened", outcomes.collections.OrderedDict())
    monkeypatch.setattr(outcomes, "VERDICTS", Verdicts())
    monkeypatch.setattr(outcomes, "RETRY_S", 0.05)
    yield outcomes._watchers
    for watcher in list(outcomes._watchers.values()):  # end this test's threads before the next test
        watcher.wanted_at = float("-inf")
    assert eventually(lambda: not outcomes._watchers)


def _watch(addr: str) -> None:
    outcomes._ensure_watching(addr, {addr})


GOOD = (200, b'{"seq": 1, "outcomes": [[7, 400, "too long"]]}')


@pytest.mark.parametrize("bad", [b"<html>", b'{"outcomes": []}', b'{"seq": 1, "outcomes": [[7, 200, "ok"]]}',
                                 b'{"seq": 1, "outcomes": [["7", 400, "x"]]}', b"[" * 100_000])
def test_a_malformed_reply_is_logged_and_the_watcher_keeps_following(bad, prefill_stand_in, watchers, caplog):
    addr, _ = prefill_stand_in((200, bad), GOOD)
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        _watch(addr)
        assert eventually(lambda: outcomes.VERDICTS.get(7) is not None), "on main the thread died on the bad reply"
    assert f"cannot read outcomes from prefill {addr}" in caplog.text


def test_a_404_is_asked_again_so_a_prefill_upgraded_in_place_is_followed(prefill_stand_in, watchers):
    addr, asked = prefill_stand_in((404, b""), GOOD)
    _watch(addr)
    assert eventually(lambda: not watchers and asked)  # stopped after the 404
    _watch(addr)
    assert addr not in watchers, "not asked again before RECHECK_S"
    outcomes._not_hardened[addr] -= outcomes.RECHECK_S  # as if RECHECK_S had passed since the 404
    _watch(addr)
    assert eventually(lambda: outcomes.VERDICTS.get(7) is not None)


def test_only_prefills_decode_bootstrapped_from_are_followed(prefill_stand_in, watchers):
    addr, asked = prefill_stand_in(GOOD)
    outcomes._ensure_watching(addr, set())  # named by a request, never bootstrapped from
    # no watcher thread started, so none can ask later
    assert not watchers and not asked and f"hardened-h4-{addr}" not in {t.name for t in threading.enumerate()}


def test_watchers_are_capped_and_stop_when_no_request_names_their_prefill(prefill_stand_in, watchers, monkeypatch):
    monkeypatch.setattr(outcomes, "WATCHERS_MAX", 2)
    monkeypatch.setattr(outcomes, "WATCH_IDLE_S", 0.5)
    addrs = [prefill_stand_in(GOOD)[0] for _ in range(3)]
    for addr in addrs:
        _watch(addr)
    assert sorted(watchers) == sorted(addrs[:2])
    assert eventually(lambda: not watchers), "idle watchers stop"
    assert not [t for t in threading.enumerate() if t.name in {f"hardened-h4-{a}" for a in addrs}]


@pytest.mark.parametrize("mode, message, counted", [
    ("prefill", TOO_LONG, True),  # upstream's admission refusal of an over-limit prompt
    ("prefill", "too long", False),  # another abort: noted for decode, not an H1 refusal
    ("decode", TOO_LONG, False),
])
def test_an_admission_refusal_on_prefill_is_counted_as_h1(monkeypatch, mode, message, counted):
    counts = []
    monkeypatch.setattr(outcomes, "OUTCOMES", OutcomeLog())
    monkeypatch.setattr(outcomes.metrics, "refused", lambda *labels: counts.append(labels))
    reason = {"type": "abort", "status_code": 400, "message": message}
    outcomes.note_prefill_finish(_prefill_manager(mode), SimpleNamespace(bootstrap_room=42),
                                 {"meta_info": {"finish_reason": reason}})
    assert counts == ([("H1", "prefill", "input_too_long")] if counted else [])


def test_catch_up_polls_share_one_listing_and_wait_like_any_reply(monkeypatch):
    """Finding (review): a poll with after=-1 skipped the coalescing and listed and serialised every
    retained outcome (up to RETAIN_MAX) for each poll at once, so a loop of them, from anyone who
    reaches the port without a token, kept prefill's HTTP process busy. Now one body serves every
    catch-up until the log changes, and each waits COALESCE_S (a lower bound: never flaky)."""
    monkeypatch.delenv(BOOTSTRAP_TOKEN.name, raising=False)
    log = OutcomeLog()
    for room in range(1000):
        log.add(room, 400, TOO_LONG)
    listed = []
    real_since = log.since
    monkeypatch.setattr(log, "since", lambda seq: listed.append(seq) or real_since(seq))

    async def run():
        async with _route_client(monkeypatch, log) as client:
            began = time.monotonic()
            replies = await asyncio.gather(*(client.get(outcomes.OUTCOMES_ROUTE, params={"after": "-1"})
                                             for _ in range(30)))
            took = time.monotonic() - began
            bodies = [await r.json() for r in replies]
            log.add(5000, 400, TOO_LONG)
            after = await (await client.get(outcomes.OUTCOMES_ROUTE, params={"after": "-1"})).json()
            return took, bodies, after

    took, bodies, after = asyncio.run(run())
    assert all(b == {"seq": 1000, "outcomes": [[r, 400, TOO_LONG] for r in range(1000)]} for b in bodies)
    assert listed == [-1, -1], f"one listing for 30 catch-ups, one after the log changed: {listed}"
    assert took >= outcomes.COALESCE_S
    assert after["seq"] == 1001 and after["outcomes"][-1] == [5000, 400, TOO_LONG]


def test_the_decode_scan_renews_each_prefill_once_and_builds_each_address_once(prefill_stand_in, watchers,
                                                                              monkeypatch):
    """The scan runs every decode loop iteration and was the costliest seam per request
    (docs/performance.md): it built each queued request's address with upstream's
    NetworkAddress and took the watchers' lock once per request, every iteration. Now each
    request's address is built once, and each prefill renewed once per iteration, without the
    lock once followed. NetworkAddress stands in for upstream's (no SGLang in this venv)."""
    addr, _ = prefill_stand_in(GOOD)
    host, port = addr.rsplit(":", 1)
    built, renewed = [], []

    class NetworkAddress:  # upstream's sglang.srt.utils.network.NetworkAddress, for an IPv4 host
        def __init__(self, h: str, p: int) -> None:
            built.append((h, p))
            self.text = f"{h}:{p}"

        def to_host_port_str(self) -> str:
            return self.text

    monkeypatch.setitem(__import__("sys").modules, "sglang.srt.utils.network", SimpleNamespace(NetworkAddress=NetworkAddress))
    real_ensure = outcomes._ensure_watching
    monkeypatch.setattr(outcomes, "_ensure_watching", lambda *a: renewed.append(a[0]) or real_ensure(*a))

    def req(room: int, host: str | None = host) -> SimpleNamespace:
        return SimpleNamespace(bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room, rid=f"r{room}",
                               finished=lambda: False)

    queue = [SimpleNamespace(req=req(room)) for room in (1, 2, 3)] + [SimpleNamespace(req=req(4, FAKE_BOOTSTRAP_HOST))]
    scheduler = SimpleNamespace(
        disagg_decode_prealloc_queue=SimpleNamespace(queue=queue[:2], kv_manager=SimpleNamespace(prefill_info_table={addr})),
        disagg_decode_transfer_queue=SimpleNamespace(queue=queue[2:]))
    for _ in range(3):
        outcomes.fail_requests_prefill_ended(scheduler)
    assert built == [(host, int(port))] * 3, "one address per request, built once"
    assert renewed == [addr] * 3, "one renewal per iteration for the three requests naming the prefill"
    assert list(watchers) == [addr]
    scheduler.disagg_decode_prealloc_queue.queue, scheduler.disagg_decode_transfer_queue.queue = [], []
    outcomes.fail_requests_prefill_ended(scheduler)
    assert renewed == [addr] * 3, "empty queues: nothing to do"
