"""The transition relation: every step prefill, decode, the transfer lane,
the client and the clock can take from a state.

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

from .configs import Switch
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
    """An action and the request it acts on (-1 for node-wide actions)."""

    action: str
    req: int = -1


# Kinds of edge, for liveness: a fault is never relied on for progress; a
# long step is a 300 s timeout, not relied on when asking for prompt endings.
NORMAL, LONG, FAULT = 0, 1, 2


class Step(NamedTuple):
    """One edge of the state graph."""

    event: Event
    target: State
    kind: int  # NORMAL, LONG or FAULT


def _with(s: State, r: int, req: Req) -> State:
    reqs = s.reqs
    return s._replace(reqs=reqs[:r] + (req,) + reqs[r + 1 :])


class Machine:
    """The protocol for one scenario under one set of switches."""

    def __init__(self, scenario: Scenario, switches: frozenset[Switch]) -> None:
        self.scenario = scenario
        self.specs = scenario.requests
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
        """Every step enabled in ``s``."""
        for r in range(len(s.reqs)):
            yield from self._prefill_steps(s, r)
            yield from self._decode_steps(s, r)
        if s.batch is not None:
            yield from self._batch_steps(s, s.batch)
        if s.faults:
            yield from self._fault_steps(s)

    def _prefill_steps(self, s: State, r: int) -> Iterator[Step]:
        q = s.reqs[r]
        spec = self.specs[r]
        if q.p in P_DONE:
            return
        if q.p_abort:
            if s.batch is None or s.batch.req != r:
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
        elif q.p == P_XFER and s.batch is None and q.sent < spec.sent_pages:
            yield Step(
                Event("batch_start", r),
                s._replace(batch=Batch(r, q.sent, False)),
                NORMAL,
            )

    def _batch_steps(self, s: State, b: Batch) -> Iterator[Step]:
        r = b.req
        q = s.reqs[r]
        if not b.landed:
            page = q.dst[b.chunk]
            pages = s.pages[:page] + (r,) + s.pages[page + 1 :]
            yield Step(
                Event("batch_land", r),
                s._replace(pages=pages, batch=b._replace(landed=True)),
                NORMAL,
            )
        else:
            returned = self._batch_returned(s, r)
            yield Step(Event("batch_return", r), returned, NORMAL)
            if s.faults and returned.reqs[r].status == ST_SUCCESS:
                # the last chunk's Success reaches decode, its metadata row never does
                lost = _with(returned, r, returned.reqs[r]._replace(status=ST_NO_METADATA))
                yield Step(Event("metadata_lost", r), lost._replace(faults=s.faults - 1), FAULT)
        if s.faults:
            failed = s._replace(batch=None, faults=s.faults - 1)
            q = q._replace(p=P_FAILED, p_abort=False)
            if q.d not in D_DONE and q.status == ST_NONE:
                q = q._replace(status=ST_FAILED)  # transport errors reach decode
            yield Step(Event("batch_fail", r), _with(failed, r, q), FAULT)

    def _batch_returned(self, s: State, r: int) -> State:
        """batch_transfer_sync returned ok; after the last chunk prefill
        polls KVPoll.Success and answers 200, unless H2 sees an abort."""
        q = s.reqs[r]._replace(sent=s.reqs[r].sent + 1)
        s = _with(s._replace(batch=None), r, q)
        if q.sent < self.specs[r].sent_pages:
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
            if (
                q.p in P_DONE
                and q.p != P_LOST
                and (s.batch is None or s.batch.req != r)
            ):
                yield Step(Event("abort_ack", r), self._release(s, r), NORMAL)
            if not self.h6 or s.batch is None or s.batch.req != r:
                yield Step(Event("release_timeout", r), self._release(s, r), NORMAL)
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

    def _commit(self, s: State, r: int) -> State:
        """_commit_transfer_to_req: upstream checks only bootstrap_room;
        H3 checks the transfer covered every page, H8 every page's tag."""
        q = s.reqs[r]
        if self.h3 and self.specs[r].sent_pages != len(q.alloc):
            return self._decode_fails(s, r)
        if self.h8 and any(s.pages[p] != r for p in q.alloc):
            return self._decode_fails(s, r)
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
        return s._replace(reqs=tuple(reqs), batch=None, crashed=True)

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
            reqs=tuple(reqs), free=tuple(range(n)), batch=None, crashed=True
        )
