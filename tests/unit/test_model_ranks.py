"""Two ranks per role: per-rank lanes and page shards, all-reduced polls, and the two
decisions decode's ranks take from their own state (a drain ack, a tag check)."""

from __future__ import annotations

from sglang_hardened.model.configs import AGREED, ALL, NAMED, SCENARIOS, Agreement
from sglang_hardened.model.machine import Event, Machine
from sglang_hardened.model.properties import pending_writes, safety_violations
from sglang_hardened.model.state import (
    D_HELD,
    P_FAILED,
    P_OK,
    P_XFER,
    PRIOR,
    ST_FAILED,
    ST_NONE,
    ST_SUCCESS,
    State,
    initial_state,
)
from tests.unit.model_results import check

(TP2,) = [sc for sc in SCENARIOS if sc.ranks == 2]


def _step(m: Machine, s: State, action: str, r: int = -1, rank: int = 0) -> State:
    (target,) = [st.target for st in m.successors(s) if st.event == Event(action, r, rank)]
    return target


def _bootstrapped(agreed: frozenset[Agreement] = AGREED) -> tuple[Machine, State]:
    m = Machine(TP2, ALL, agreed)
    s = initial_state(TP2)
    for action in ("prefill_admit", "decode_admit", "decode_alloc", "prefill_bootstrap"):
        s = _step(m, s, action, 0)
    return m, s


def _send(m: Machine, s: State, rank: int, chunks: int, last: str = "batch_land") -> State:
    for _ in range(chunks):
        for action in ("batch_start", last, "batch_return"):
            s = _step(m, s, action, 0, rank)
    return s


def test_success_waits_for_every_rank() -> None:
    m, s = _bootstrapped()
    s = _send(m, s, 0, 2)
    assert (s.reqs[0].p, s.reqs[0].status, s.reqs[0].sent) == (P_XFER, ST_NONE, (2, 0))
    assert s.pages == ((0, 0, PRIOR, PRIOR), (PRIOR,) * 4)
    s = _send(m, s, 1, 2)
    assert (s.reqs[0].p, s.reqs[0].status) == (P_OK, ST_SUCCESS)


def _one_rank_failed_other_writing(agreed: frozenset[Agreement]) -> tuple[Machine, State]:
    m, s = _bootstrapped(agreed)
    s = _step(m, _step(m, s, "batch_start", 0, 0), "batch_start", 0, 1)
    s = _step(m, s, "batch_fail", 0, 1)
    assert (s.reqs[0].p, s.reqs[0].status) == (P_FAILED, ST_FAILED)
    assert pending_writes(s, TP2) == {0: 0}  # rank 0's call is still under way
    return m, _step(m, s, "decode_fail", 0)


def test_agreed_release_waits_for_the_rank_still_writing() -> None:
    m, s = _one_rank_failed_other_writing(AGREED)
    assert s.reqs[0].d == D_HELD
    assert not [st for st in m.successors(s) if st.event.action in ("abort_ack", "release_timeout")]
    s = _step(m, _step(m, s, "batch_land", 0, 0), "batch_return", 0, 0)
    assert _step(m, s, "abort_ack", 0).free == (2, 3, 0, 1)


def test_a_rank_releasing_alone_diverges() -> None:
    m, s = _one_rank_failed_other_writing(frozenset({Agreement.VERDICT}))
    alone = _step(m, s, "abort_ack", 0, 1)  # rank 1's prefill rank has drained
    (v,) = safety_violations(alone, TP2)
    assert v.kind == "ranks-diverge" and "decode rank 1 frees r0's pages" in v.message
    assert not list(m.successors(alone))


def _skipped_on_rank_1(agreed: frozenset[Agreement]) -> tuple[Machine, State]:
    m, s = _bootstrapped(agreed)
    s = _send(m, _send(m, s, 0, 2), 1, 1)
    s = _send(m, s, 1, 1, last="batch_skip")
    assert s.reqs[0].status == ST_SUCCESS and s.pages[1] == (0, PRIOR, PRIOR, PRIOR)
    return m, s


def test_tag_verdicts_are_shared_before_anyone_acts() -> None:
    m, s = _skipped_on_rank_1(AGREED)
    assert _step(m, s, "decode_commit", 0).reqs[0].d == D_HELD
    m, s = _skipped_on_rank_1(frozenset({Agreement.RELEASE}))
    (v,) = safety_violations(_step(m, s, "decode_commit", 0), TP2)
    assert v.kind == "ranks-diverge" and "rank 1 refuses r0's transfer" in v.message


def test_releases_before_0_5_23_diverge_across_ranks() -> None:
    # upstream all-reduces its deferred releases from 0.5.23 on; 0.5.21/0.5.22 hold per rank
    for base in ("0.5.21", "0.5.22"):
        res = check(NAMED[f"upstream-{base}"], (TP2,))
        assert "ranks-diverge" in res.kinds
    assert "ranks-diverge" not in check(NAMED["upstream-0.5.23"], (TP2,)).kinds
    # with no deferred release (0.5.19) decode frees at once on every rank alike
    assert "ranks-diverge" not in check(NAMED["upstream-0.5.19"], (TP2,)).kinds

