"""The transition relation: every step prefill, decode, the transfer lane,
the client and the clock can take from a state.

With more than one rank per role (``Scenario.ranks``) each rank has its own
transfer lane and its own shard of every page; what upstream all-reduces
(transfer polls) is one shared value, and what a rank decides from its own
state (a drain ack, a tag check) is where the ranks can disagree.

Each action is one atomic step of upstream code (docs/model.md maps them).
Each step says what kind of edge it is, because liveness treats them
differently: a FAULT (client disconnect, transport failure, crash) may
happen but is never relied on for progress; a LONG step (decode's waiting
timeout, prefill's bootstrap timeout, 300 s by default) is relied on only
when asking whether requests end at all, not whether they end promptly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from .configs import AGREED, Agreement, Switch
from .state import (
    D_DONE,
    D_FAILED,
    D_HELD,
    D_LOST,
    D_NEW,
    D_OK,
    D_PREALLOC,
    D_RUN,
    D_WAIT,
    P_BOOT,
    P_DONE,
    P_FAILED,
    P_LOST,
    P_NEW,
    P_OK,
    P_REJECTED,
    P_XFER,
    ST_FAILED,
    ST_NO_METADATA,
    ST_NONE,
    ST_SUCCESS,
    Batch,
    Kind,
    Req,
    Scenario,
    State,
)

#: Every action the machine can take; docs/model.md maps each to code.
ACTIONS = (
    "prefill_admit",
    "prefill_reject",
    "prefill_bootstrap",
    "prefill_retire",
    "prefill_bootstrap_timeout",
    "prefill_abort",
    "batch_start",
    "batch_land",
    "batch_return",
    "batch_fail",
    "batch_skip",
    "metadata_lost",
    "decode_admit",
    "decode_alloc",
    "decode_commit",
    "decode_fail",
    "decode_drop",
    "decode_waiting_timeout",
    "metadata_timeout",
    "decode_finish",
    "decode_abort",
    "abort_ack",
    "release_timeout",
    "client_disconnect",
    "prefill_crash",
    "decode_crash",
)


class Event(NamedTuple):
    """An action, the request it acts on (-1 for node-wide actions) and the
    rank whose lane or whose decision it is (0 with one rank)."""

    action: str
    req: int = -1
    rank: int = 0


# Kinds of edge, for liveness: a fault is never relied on for progress; a
# long step is a 300 s timeout, not relied on when asking for prompt endings.
NORMAL, LONG, FAULT = 0, 1, 2


class Step(NamedTuple):
    """One edge of the state graph."""

    event: Event
    target: State
    kind: int  # NORMAL, LONG or FAULT


def _put(t: tuple, i: int, v: object) -> tuple:
    """``t`` with item ``i`` replaced by ``v``."""
    return t[:i] + (v,) + t[i + 1 :]


def _with(s: State, r: int, req: Req) -> State:
    return s._replace(reqs=_put(s.reqs, r, req))


class Machine:
    """The protocol for one scenario under one set of switches."""

    def __init__(
        self,
        scenario: Scenario,
        switches: frozenset[Switch],
        agreed: frozenset[Agreement] = AGREED,
    ) -> None:
        self.scenario = scenario
        self.specs = scenario.requests
        self.release_agreed = Agreement.RELEASE in agreed
        self.verdict_agreed = Agreement.VERDICT in agreed
        self.h1 = Switch.H1 in switches
        self.h2 = Switch.H2 in switches
        self.h3 = Switch.H3 in switches
        self.h4 = Switch.H4 in switches
        self.h5 = Switch.H5 in switches
        self.h6 = Switch.H6 in switches
        self.h8 = Switch.H8 in switches
        self.h13 = Switch.H13 in switches

    # -- shared effects -------------------------------------------------

    def _prefill_fails(self, s: State, r: int, phase: str = P_FAILED) -> State:
        """Prefill ends the request with an error; H4 tells decode at once."""
        q = s.reqs[r]._replace(p=phase, p_abort=False)
        if self.h4 and q.d not in D_DONE and q.status == ST_NONE:
            q = q._replace(status=ST_FAILED)
        return _with(s, r, q)

    def _release(self, s: State, r: int, phase: str = D_FAILED) -> State:
        """Decode ends the request and frees its pages to the back of the
        free list."""
        q = s.reqs[r]
        s = s._replace(free=s.free + q.alloc)
        return _with(s, r, q._replace(d=phase, alloc=(), d_abort=False))

    def _decode_fails(self, s: State, r: int) -> State:
        """Decode aborts a request that holds pages.

        With H5 the pages stay held and prefill is sent an abort frame;
        without it they go back to the free list at once, whatever prefill
        is still writing into them.
        """
        q = s.reqs[r]
        if not q.alloc:
            return _with(s, r, q._replace(d=D_FAILED, d_abort=False))
        if not self.h5:
            return self._release(s, r)
        return _with(
            s,
            r,
            q._replace(d=D_HELD, d_abort=False, p_abort=q.p_abort or q.p not in P_DONE),
        )

    # -- the relation ---------------------------------------------------

    def successors(self, s: State) -> Iterator[Step]:
        """Every step enabled in ``s`` (none once the ranks have diverged)."""
        if s.diverged:
            return
        for r in range(len(s.reqs)):
            yield from self._prefill_steps(s, r)
            yield from self._decode_steps(s, r)
        for k, b in enumerate(s.lanes):
            if b is not None:
                yield from self._batch_steps(s, k, b)
        if s.faults:
            yield from self._fault_steps(s)

    def _prefill_steps(self, s: State, r: int) -> Iterator[Step]:
        q = s.reqs[r]
        spec = self.specs[r]
        if q.p in P_DONE:
            return
        if q.p_abort:
            if not s.busy(r):
                yield Step(Event("prefill_abort", r), self._prefill_fails(s, r), NORMAL)
            return
        if q.p == P_NEW:
            if spec.kind is Kind.OVER and self.h1:
                yield Step(
                    Event("prefill_reject", r),
                    self._prefill_fails(s, r, P_REJECTED),
                    NORMAL,
                )
            else:
                over = spec.kind is Kind.OVER
                yield Step(
                    Event("prefill_admit", r),
                    _with(s, r, q._replace(p=P_BOOT, tofinish=over)),
                    NORMAL,
                )
        elif q.p == P_BOOT:
            if q.d == D_WAIT:
                if self.h2 and q.tofinish:
                    yield Step(
                        Event("prefill_retire", r), self._prefill_fails(s, r), NORMAL
                    )
                else:
                    yield Step(
                        Event("prefill_bootstrap", r),
                        _with(s, r, q._replace(p=P_XFER, dst=q.alloc)),
                        NORMAL,
                    )
            else:
                yield Step(
                    Event("prefill_bootstrap_timeout", r),
                    self._prefill_fails(s, r),
                    LONG,
                )
        elif q.p == P_XFER:
            for k, b in enumerate(s.lanes):
                if b is None and q.sent[k] < spec.sent_pages:
                    yield Step(
                        Event("batch_start", r, k),
                        s._replace(lanes=_put(s.lanes, k, Batch(r, q.sent[k], False))),
                        NORMAL,
                    )

    def _batch_steps(self, s: State, k: int, b: Batch) -> Iterator[Step]:
        r = b.req
        q = s.reqs[r]
        if not b.landed:
            page = q.dst[b.chunk]
            pages = _put(s.pages, k, _put(s.pages[k], page, r))
            landed = _put(s.lanes, k, b._replace(landed=True))
            yield Step(
                Event("batch_land", r, k),
                s._replace(pages=pages, lanes=landed),
                NORMAL,
            )
            if s.faults and self.scenario.skips:
                # reported written, never landed where decode reads it (a dropped page, a
                # wrong index): the class of transfer bug H8's tags exist for
                yield Step(
                    Event("batch_skip", r, k),
                    s._replace(lanes=landed, faults=s.faults - 1),
                    FAULT,
                )
        else:
            returned = self._batch_returned(s, k, r)
            yield Step(Event("batch_return", r, k), returned, NORMAL)
            if s.faults and returned.reqs[r].status == ST_SUCCESS:
                # the last chunk's Success reaches decode, its metadata row never does
                lost = _with(returned, r, returned.reqs[r]._replace(status=ST_NO_METADATA))
                yield Step(Event("metadata_lost", r, k), lost._replace(faults=s.faults - 1), FAULT)
        if s.faults:
            failed = s._replace(lanes=_put(s.lanes, k, None), faults=s.faults - 1)
            if q.p == P_XFER:  # the first rank to fail fails the room (prefill's poll is MIN)
                q = q._replace(p=P_FAILED, p_abort=False)
                if q.d not in D_DONE and q.status == ST_NONE:
                    q = q._replace(status=ST_FAILED)  # transport errors reach decode
            yield Step(Event("batch_fail", r, k), _with(failed, r, q), FAULT)

    def _batch_returned(self, s: State, k: int, r: int) -> State:
        """batch_transfer_sync returned ok on rank ``k``; once every rank's
        last chunk has, prefill polls KVPoll.Success (all-reduced) and answers
        200, unless H2 sees an abort. A lane still writing for a room another
        rank already failed just finishes."""
        q0 = s.reqs[r]
        q = q0._replace(sent=_put(q0.sent, k, q0.sent[k] + 1))
        s = _with(s._replace(lanes=_put(s.lanes, k, None)), r, q)
        if q.p != P_XFER or any(n < self.specs[r].sent_pages for n in q.sent):
            return s
        if self.h2 and (q.tofinish or q.p_abort):
            return self._prefill_fails(s, r)
        q = q._replace(p=P_OK, p_abort=False)
        if q.d not in D_DONE and q.status == ST_NONE:
            q = q._replace(status=ST_SUCCESS)
        return _with(s, r, q)

    def _decode_steps(self, s: State, r: int) -> Iterator[Step]:
        q = s.reqs[r]
        if q.d in D_DONE:
            return
        if q.d == D_HELD:
            yield from self._hold_steps(s, r)
            return
        if q.d_abort:
            if q.d == D_RUN:
                yield Step(Event("decode_abort", r), self._release(s, r), NORMAL)
            else:
                yield Step(Event("decode_abort", r), self._decode_fails(s, r), NORMAL)
            return
        if q.d in (D_NEW, D_PREALLOC) and q.status == ST_FAILED:
            yield Step(
                Event("decode_drop", r), _with(s, r, q._replace(d=D_FAILED)), NORMAL
            )
        elif q.d == D_NEW:
            yield Step(
                Event("decode_admit", r), _with(s, r, q._replace(d=D_PREALLOC)), NORMAL
            )
        elif q.d == D_PREALLOC:
            need = self.specs[r].decode_pages
            if len(s.free) >= need:
                s2 = s._replace(free=s.free[need:])
                yield Step(
                    Event("decode_alloc", r),
                    _with(s2, r, q._replace(d=D_WAIT, alloc=s.free[:need])),
                    NORMAL,
                )
        elif q.d == D_WAIT:
            if q.status == ST_SUCCESS:
                yield Step(Event("decode_commit", r), self._commit(s, r), NORMAL)
            elif q.status == ST_FAILED:
                yield Step(Event("decode_fail", r), self._decode_fails(s, r), NORMAL)
            elif q.status == ST_NO_METADATA:
                # upstream's metadata gate holds it as Transferring, with no timeout
                if self.h13:
                    yield Step(Event("metadata_timeout", r), self._decode_fails(s, r), NORMAL)
            else:
                yield Step(
                    Event("decode_waiting_timeout", r), self._decode_fails(s, r), LONG
                )
        elif q.d == D_RUN:
            yield Step(Event("decode_finish", r), self._release(s, r, D_OK), NORMAL)

    def _hold_steps(self, s: State, r: int) -> Iterator[Step]:
        """A deferred release ends on prefill's drain ack or its timeout.

        Each decode rank hears its own prefill rank's ack and reads its own
        clock; upstream 0.5.23 all-reduces "may release" so that every rank
        frees together (Agreement.RELEASE). Without that, one rank freeing
        alone is a divergence, whatever the others do next.
        """
        q = s.reqs[r]
        drained = [
            q.p in P_DONE and q.p != P_LOST and (b is None or b.req != r)
            for b in s.lanes
        ]
        may_time_out = [not self.h6 or b is None or b.req != r for b in s.lanes]
        if all(drained):
            yield Step(Event("abort_ack", r), self._release(s, r), NORMAL)
        if all(may_time_out):
            yield Step(Event("release_timeout", r), self._release(s, r), NORMAL)
        if self.release_agreed or len(s.lanes) == 1:
            return
        for action, ready, why in (
            ("abort_ack", drained, "on its prefill rank's drain ack"),
            ("release_timeout", may_time_out, "at its own release deadline"),
        ):
            if any(ready):
                k = ready.index(True)
                yield Step(
                    Event(action, r, k),
                    s._replace(
                        diverged=f"decode rank {k} frees r{r}'s pages {list(q.alloc)} {why} "
                        "while the other ranks still hold them: their free lists differ"
                    ),
                    NORMAL,
                )

    def _commit(self, s: State, r: int) -> State:
        """_commit_transfer_to_req: upstream checks only bootstrap_room;
        H3 checks the transfer covered every page, H8 every page's tag on
        every rank (each rank checks its own shard, then they agree:
        Agreement.VERDICT)."""
        q = s.reqs[r]
        if self.h3 and self.specs[r].sent_pages != len(q.alloc):
            return self._decode_fails(s, r)
        if self.h8:
            refused = [any(pages[p] != r for p in q.alloc) for pages in s.pages]
            if all(refused) or (any(refused) and self.verdict_agreed):
                return self._decode_fails(s, r)
            if any(refused):
                return s._replace(
                    diverged=f"decode rank {refused.index(True)} refuses r{r}'s transfer (a page "
                    f"without its tag) while rank {refused.index(False)} decodes it"
                )
        return _with(s, r, q._replace(d=D_RUN))

    def _fault_steps(self, s: State) -> Iterator[Step]:
        spent = s._replace(faults=s.faults - 1)
        for r, q in enumerate(s.reqs):
            p_live = q.p not in P_DONE
            d_live = q.d not in D_DONE and q.d != D_HELD
            if p_live or d_live:
                q2 = q._replace(
                    p_abort=q.p_abort or p_live, d_abort=q.d_abort or d_live
                )
                yield Step(Event("client_disconnect", r), _with(spent, r, q2), FAULT)
        yield Step(Event("prefill_crash"), self._prefill_crash(spent), FAULT)
        yield Step(Event("decode_crash"), self._decode_crash(spent), FAULT)

    def _prefill_crash(self, s: State) -> State:
        """Prefill dies and restarts: the requests it had taken in are lost,
        its batch stops, and decode's heartbeat fails their receivers.
        Requests that had not reached it yet arrive at the new process."""
        reqs = []
        for q in s.reqs:
            if q.p not in P_DONE and q.p != P_NEW:
                q = q._replace(p=P_LOST, p_abort=False)
                if q.d not in D_DONE and q.status == ST_NONE:
                    q = q._replace(status=ST_FAILED)
            reqs.append(q)
        return s._replace(reqs=tuple(reqs), lanes=(None,) * len(s.lanes), crashed=True)

    def _decode_crash(self, s: State) -> State:
        """Decode dies and restarts with a fresh free list, page contents
        surviving: the requests it had taken in are lost, writes to the dead
        peer stop, and prefill's heartbeat fails their prefill halves.
        Requests that had not reached it yet arrive at the new process."""
        reqs = []
        for q in s.reqs:
            if q.d not in D_DONE and q.d != D_NEW:
                q = q._replace(d=D_LOST, alloc=(), d_abort=False)
                if q.p not in P_DONE:
                    q = q._replace(p=P_FAILED, p_abort=False)
            reqs.append(q)
        n = self.scenario.pool_pages
        return s._replace(
            reqs=tuple(reqs), free=tuple(range(n)), lanes=(None,) * len(s.lanes), crashed=True
        )
