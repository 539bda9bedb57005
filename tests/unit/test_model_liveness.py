"""Liveness: requests end and aborts resolve under fairness; with H4,
failures reach decode without a 300 s wait. And the checks can fail."""

from __future__ import annotations

from collections.abc import Iterator

from sglang_hardened.model.checker import CheckResult, explore
from sglang_hardened.model.configs import SCENARIOS, parse_config
from sglang_hardened.model.machine import FAULT, Machine, Step
from sglang_hardened.model.state import D_WAIT, P_DONE, State
from tests.unit.model_results import check


class _Without(Machine):
    """A broken variant of the protocol, to show a check notices it."""

    dropped: frozenset[str] = frozenset()

    def successors(self, s: State) -> Iterator[Step]:
        return (
            st for st in super().successors(s) if st.event.action not in self.dropped
        )


def _broken(dropped: set[str], config: str) -> CheckResult:
    variant = type("Variant", (_Without,), {"dropped": frozenset(dropped)})
    res = CheckResult(parse_config(config))
    res.results = [explore(variant(sc, res.config.switches)) for sc in SCENARIOS]
    return res


def test_without_h4_decode_waits_out_its_timeout() -> None:
    res = check(parse_config("H1,H2,H3,H5,H6,H8,H13"))
    stuck = next(f for f in res.findings if f.kind == "prompt-failure")
    assert "decode_waiting_timeout" in stuck.message
    _, last = stuck.trace[-1]
    waiting = [q for q in last.reqs if q.d == D_WAIT]
    assert waiting and all(q.p in P_DONE for q in waiting)
    # a client disconnect would still end it: faults are not relied on
    machine = Machine(stuck.scenario, res.config.switches)
    assert any(st.kind == FAULT for st in machine.successors(last))
    assert not any(e.action.endswith("timeout") for e, _ in stuck.trace)


def test_a_missing_release_timeout_strands_a_hold() -> None:
    # after a prefill crash nobody acks; only the timeout frees the pages
    res = _broken({"release_timeout"}, "hardened-0.5.23")
    stuck = next(f for f in res.findings if f.kind == "aborts-resolve")
    assert any(e.action == "prefill_crash" for e, _ in stuck.trace)


def test_without_timeouts_upstream_never_ends_a_rejected_request() -> None:
    # 0.5.21's items plus H13, whose absence strands a request of its own (metadata lost)
    res = _broken({"decode_waiting_timeout", "prefill_bootstrap_timeout"}, "H1,H2,H5,H13")
    assert "requests-end" in res.kinds
    assert "requests-end" not in check(parse_config("H1,H2,H5,H13")).kinds
