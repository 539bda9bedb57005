"""The pieces under the search: canonical states, guards, predicates."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator

from sglang_hardened.model.configs import ALL, SCENARIOS, Switch
from sglang_hardened.model.machine import ACTIONS, Event, Machine, Step
from sglang_hardened.model.properties import pending_writes, safety_violations
from sglang_hardened.model.report import describe
from sglang_hardened.model.state import (
    D_HELD,
    D_WAIT,
    P_XFER,
    PRIOR,
    ST_SUCCESS,
    Batch,
    State,
    initial_state,
)
from tests.harness import REPO

OVER_POOL, TRUNCATION, ABORT_REUSE, OVER_POOL_TP2 = SCENARIOS


def _step(m: Machine, s: State, action: str, r: int = -1) -> State:
    (target,) = [st.target for st in m.successors(s) if st.event == Event(action, r)]
    return target


def test_independent_steps_commute_to_one_canonical_state() -> None:
    m = Machine(ABORT_REUSE, ALL)
    s0 = initial_state(ABORT_REUSE)
    a = _step(m, _step(m, s0, "prefill_admit", 0), "decode_admit", 1)
    b = _step(m, _step(m, s0, "decode_admit", 1), "prefill_admit", 0)
    assert a == b and hash(a) == hash(b)
    assert s0.pages == ((PRIOR,) * 4,) and s0.free == (0, 1, 2, 3)


def test_free_list_is_fifo() -> None:
    m = Machine(ABORT_REUSE, ALL)
    s = initial_state(ABORT_REUSE)
    for action in ("decode_admit", "decode_alloc"):
        s = _step(m, s, action, 0)
    assert s.reqs[0].alloc == (0, 1) and s.free == (2, 3)
    s = _step(m, s, "client_disconnect", 0)
    s = _step(m, s, "decode_abort", 0)  # H5: held, not freed
    assert s.reqs[0].d == D_HELD and s.free == (2, 3)
    s = _step(m, s, "release_timeout", 0)
    assert s.free == (2, 3, 0, 1)


def _held_with_batch_in_flight(switches: frozenset[Switch]) -> tuple[Machine, State]:
    m = Machine(ABORT_REUSE, switches)
    s = initial_state(ABORT_REUSE)
    for action in (
        "prefill_admit",
        "decode_admit",
        "decode_alloc",
        "prefill_bootstrap",
        "batch_start",
    ):
        s = _step(m, s, action, 0)
    s = _step(m, s, "decode_waiting_timeout", 0)
    assert s.reqs[0].d == D_HELD and s.lanes == (Batch(0, 0, False),)
    return m, s


def test_h6_keeps_the_release_timeout_behind_a_running_batch() -> None:
    m, s = _held_with_batch_in_flight(ALL)
    assert "release_timeout" not in {st.event.action for st in m.successors(s)}
    m, s = _held_with_batch_in_flight(ALL - {Switch.H6})
    freed = _step(m, s, "release_timeout", 0)
    assert freed.free == (2, 3, 0, 1)


def test_pending_writes_follow_the_batch_and_the_abort() -> None:
    m, s = _held_with_batch_in_flight(ALL)
    # the abort frame stopped further chunks: only the running batch may land
    assert s.reqs[0].p == P_XFER and s.reqs[0].p_abort
    assert pending_writes(s, ABORT_REUSE) == {0: 0}
    landed = _step(m, s, "batch_land", 0)
    assert pending_writes(landed, ABORT_REUSE) == {}
    live = s._replace(reqs=(s.reqs[0]._replace(p_abort=False), s.reqs[1]))
    assert pending_writes(live, ABORT_REUSE) == {0: 0, 1: 0}


def test_reuse_under_write_is_a_state_predicate() -> None:
    _, s = _held_with_batch_in_flight(ALL - {Switch.H6})
    r1 = s.reqs[1]._replace(d=D_WAIT, alloc=(2, 3, 0))
    bad = s._replace(reqs=(s.reqs[0]._replace(d="failed", alloc=()), r1))
    (v,) = safety_violations(bad, ABORT_REUSE)
    assert v.kind == "reuse-under-write" and "page 0 is allocated to r1" in v.message


def _bootstrapped(m: Machine, s: State, r: int) -> State:
    """Request r admitted on both roles, its decode pages allocated, bootstrapped."""
    for action in ("prefill_admit", "decode_admit", "decode_alloc", "prefill_bootstrap"):
        s = _step(m, s, action, r)
    return s


def _truncated_transfer_done(switches: frozenset[Switch]) -> tuple[Machine, State]:
    m = Machine(TRUNCATION, switches)
    s = _bootstrapped(m, initial_state(TRUNCATION), 1)
    for _ in range(2):
        for action in ("batch_start", "batch_land", "batch_return"):
            s = _step(m, s, action, 1)
    assert s.reqs[1].status == ST_SUCCESS and s.pages == ((1, 1, PRIOR, PRIOR),)
    return m, s


def test_commit_checks_refuse_an_uncovered_page() -> None:
    for off in (frozenset({Switch.H3}), frozenset({Switch.H8})):
        m, s = _truncated_transfer_done(ALL - off)
        assert _step(m, s, "decode_commit", 1).reqs[1].d == D_HELD
    m, s = _truncated_transfer_done(ALL - {Switch.H3, Switch.H8})
    read = _step(m, s, "decode_commit", 1)
    assert [v.kind for v in safety_violations(read, TRUNCATION)] == ["foreign-read"]


def test_h1_rejects_and_h4_tells_decode() -> None:
    m = Machine(OVER_POOL, frozenset({Switch.H1}))
    s = _step(m, initial_state(OVER_POOL), "prefill_reject", 1)
    assert s.reqs[1].p == "rejected" and s.reqs[1].status == ""
    m = Machine(OVER_POOL, frozenset({Switch.H1, Switch.H4}))
    s = _step(m, initial_state(OVER_POOL), "prefill_reject", 1)
    assert s.reqs[1].status == "failed"


def test_decode_crash_keeps_page_contents_and_later_arrivals() -> None:
    m = Machine(ABORT_REUSE, ALL)
    s = _bootstrapped(m, initial_state(ABORT_REUSE), 0)
    s = _step(m, _step(m, s, "batch_start", 0), "batch_land", 0)
    crashed = _step(m, s, "decode_crash")
    assert crashed.free == (0, 1, 2, 3) and crashed.pages[0][0] == 0
    assert crashed.lanes == (None,) and crashed.crashed
    assert (crashed.reqs[0].d, crashed.reqs[0].p) == ("lost", "failed")
    assert crashed.reqs[1] == s.reqs[1]  # r1 reaches the restarted decode later


def _edges(m: Machine, limit: int) -> Iterator[tuple[State, Step]]:
    """Breadth-first edges of a machine, up to ``limit`` states."""
    seen = {initial_state(m.scenario)}
    todo = deque(seen)
    while todo:
        s = todo.popleft()
        for st in m.successors(s):
            yield s, st
            if st.target not in seen and len(seen) < limit:
                seen.add(st.target)
                todo.append(st.target)


def test_every_action_is_reachable_described_and_documented() -> None:
    doc = (REPO / "docs" / "model.md").read_text()
    seen: set[str] = set()
    for sc in SCENARIOS:
        for switches in (ALL, frozenset(), frozenset({Switch.H2})):
            m = Machine(sc, switches)
            for s, st in _edges(m, 20_000):
                assert st.event.action in ACTIONS
                seen.add(st.event.action)
                assert describe(sc, st.event, s, st.target)
    assert seen == set(ACTIONS)
    documented = set(re.findall(r"^\| `([a-z_]+)`", doc, re.M))
    documented |= {a for a in ACTIONS if f"`{a}`" in doc}
    assert set(ACTIONS) <= documented
