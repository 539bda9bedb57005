"""Words for the checker's results: numbered traces and the summary table.

Events are stored as bare (action, request) pairs so the search stays
fast; the sentences are built here, only for the traces that get printed,
from the states before and after each step.
"""

from __future__ import annotations

from .checker import CheckResult, Finding
from .machine import Event
from .properties import writer_name
from .state import (
    D_HELD,
    D_RUN,
    P_FAILED,
    P_OK,
    P_XFER,
    ST_FAILED,
    Kind,
    Scenario,
    State,
)


def _who(sc: Scenario, r: int) -> str:
    spec = sc.requests[r]
    return f"r{r} ({sc.tenant(r)}, {spec.kind.value}, {spec.decode_pages} pages)"


def _decode_outcome(before: State, after: State, r: int) -> str:
    """How decode's side of ``r`` ended up after an abort or failure."""
    q0, q = before.reqs[r], after.reqs[r]
    if q.d == D_HELD:
        return f"pages {list(q.alloc)} held for deferred release, abort frame sent to prefill"
    if q0.alloc and not q.alloc:
        return f"pages {list(q0.alloc)} freed at once"
    return "no pages to free"


def _told_decode(before: State, after: State, r: int) -> str:
    if before.reqs[r].status != ST_FAILED and after.reqs[r].status == ST_FAILED:
        return "; decode is told at once"
    return ""


def describe(sc: Scenario, event: Event, before: State, after: State) -> str:
    """One sentence for one step."""
    r = event.req
    a = event.action
    if r < 0:
        if a == "prefill_crash":
            return (
                "prefill crashes and restarts: the requests it had taken in are lost; "
                "decode's heartbeat fails their receivers"
            )
        return (
            "decode crashes and restarts: the requests it had taken in are lost, its free "
            "list is fresh, page contents survive; prefill's heartbeat fails their senders"
        )
    who = _who(sc, r)
    q0, q = before.reqs[r], after.reqs[r]
    spec = sc.requests[r]
    b = before.lanes[event.rank]
    on = f" on rank {event.rank}" if sc.ranks > 1 else ""
    if after.diverged and not before.diverged:
        return after.diverged
    if a == "prefill_admit":
        if spec.kind is Kind.OVER:
            return (
                f"prefill admits {who}: validate_input_length fails, set_finish_with_abort "
                "replaces the prompt with one token and parks the error in req.to_finish"
            )
        if spec.kind is Kind.TRUNC:
            return f"prefill truncates {who} to {spec.sent_pages} pages (--allow-auto-truncate) and admits it"
        return f"prefill admits {who} into PrefillBootstrapQueue"
    if a == "prefill_reject":
        return f"prefill rejects {who} at admission: the client gets 400{_told_decode(before, after, r)}"
    if a == "prefill_bootstrap":
        return (
            f"prefill bootstraps {who} with decode's page indices {list(q.dst)}, runs the forward; "
            f"it will send {spec.sent_pages} page(s)"
        )
    if a == "prefill_retire":
        return f"prefill retires {who} after its one-token forward: error to the client{_told_decode(before, after, r)}"
    if a == "prefill_bootstrap_timeout":
        return f"prefill's bootstrap timeout (300 s) fails {who}{_told_decode(before, after, r)}"
    if a == "prefill_abort":
        return f"prefill aborts {who}{_told_decode(before, after, r)}"
    if a == "batch_start":
        c = after.lanes[event.rank]
        assert c is not None
        return (
            f"prefill{on} starts batch_transfer_sync for {who}, chunk {c.chunk + 1}/{spec.sent_pages} "
            f"-> decode page {q.dst[c.chunk]}"
        )
    if a == "batch_land":
        assert b is not None
        return (
            f"r{r}'s write of chunk {b.chunk + 1}{on} lands in decode page {q.dst[b.chunk]}"
        )
    if a == "batch_skip":
        assert b is not None
        return (
            f"r{r}'s write of chunk {b.chunk + 1}{on} is reported done but never lands in decode "
            f"page {q.dst[b.chunk]} (a dropped page or a wrong index)"
        )
    if a == "batch_return":
        assert b is not None
        text = f"batch_transfer_sync{on} returns ok for r{r} chunk {b.chunk + 1}/{spec.sent_pages}"
        if q0.p != P_XFER:
            text += "; the room has already failed, the lane only finishes"
        elif q.p == P_OK:
            text += "; prefill polls KVPoll.Success and answers 200, decode's receiver sees Success"
        elif q.p == P_FAILED:
            text += (
                "; prefill sees the pending abort and reports an error"
                + _told_decode(before, after, r)
            )
        return text
    if a == "batch_fail":
        assert b is not None
        return f"r{r}'s batch for chunk {b.chunk + 1}{on} fails (transport error); decode's receiver sees Failed"
    if a == "metadata_lost":
        return (f"r{r}'s last batch returns and prefill reports Success, but its metadata row never "
                "reaches decode (an AUX_DATA frame dropped): decode's metadata gate holds it")
    if a == "metadata_timeout":
        return f"the gate's hold on r{r} ends at the release timeout (H13): {_decode_outcome(before, after, r)}"
    if a == "decode_admit":
        return f"decode admits {who} into DecodePreallocQueue"
    if a == "decode_alloc":
        held = ", ".join(f"{p}: {writer_name(sc, before.pages[0][p])}" for p in q.alloc)
        return f"decode preallocates pages {list(q.alloc)} for r{r} (they hold KV of {held})"
    if a == "decode_drop":
        return f"decode drops {who}: its prefill failed before any allocation"
    if a == "decode_commit":
        if q.d == D_RUN:
            return (
                f"decode commits r{r}'s transfer (_commit_transfer_to_req: bootstrap_room matches) "
                "and starts decoding over its pages"
            )
        return f"decode's coverage/tag check refuses r{r}'s transfer: {_decode_outcome(before, after, r)}"
    if a == "decode_fail":
        return (
            f"decode sees r{r}'s transfer failed: {_decode_outcome(before, after, r)}"
        )
    if a == "decode_waiting_timeout":
        return f"decode's waiting timeout (300 s) aborts r{r}: {_decode_outcome(before, after, r)}"
    if a == "decode_finish":
        return f"decode finishes r{r} and answers 200; pages {list(q0.alloc)} go to the back of the free list"
    if a == "decode_abort":
        return f"decode handles the client's abort of r{r}: {_decode_outcome(before, after, r)}"
    if a == "abort_ack":
        return f"prefill acks r{r}'s abort once drained; decode frees pages {list(q0.alloc)}"
    if a == "release_timeout":
        still = " while its batch is still writing" if before.busy(r) else ""
        return f"the deferred-release timeout (30 s) frees r{r}'s pages {list(q0.alloc)}{still}"
    if a == "client_disconnect":
        return f"the client of {who} disconnects: aborts go to prefill and decode"
    raise ValueError(f"no words for {a}")


def format_finding(f: Finding) -> str:
    """A violation with its numbered trace."""
    lines = [f"VIOLATION {f.kind} (scenario {f.scenario.name}): {f.message}"]
    before = f.initial
    for n, (event, after) in enumerate(f.trace, 1):
        lines.append(f"  {n:2d}. {describe(f.scenario, event, before, after)}")
        before = after
    return "\n".join(lines)


def format_table(results: list[CheckResult]) -> str:
    """One row per configuration: states explored, result, seconds."""
    rows = [("config", "states", "result", "seconds")]
    for res in results:
        verdict = "clean" if res.clean else "VIOLATED: " + ", ".join(res.kinds)
        rows.append((res.config.name, str(res.states), verdict, f"{res.seconds:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:<{widths[2]}}  {d:>7}".rstrip()
        for a, b, c, d in rows
    )
