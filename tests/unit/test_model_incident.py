"""The revert test: upstream 0.5.19's configuration must reproduce the incident.

An over-pool request is admitted with a one-token placeholder, prefill
sends one page and answers 200, and decode decodes over pages that still
hold another tenant's KV. The checker must find that, and print it as a
numbered sequence of events someone can read.
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from sglang_hardened.model.checker import CheckResult
from sglang_hardened.model import cli
from sglang_hardened.model.cli import model
from sglang_hardened.model.configs import NAMED
from sglang_hardened.model.machine import Machine
from sglang_hardened.model.report import format_finding
from sglang_hardened.model.state import D_RUN, PRIOR, Kind, initial_state
from tests.unit.model_results import check


@pytest.fixture(scope="module")
def upstream_19() -> CheckResult:
    return check(NAMED["upstream-0.5.19"])


def test_incident_is_found_and_reported_first(upstream_19: CheckResult) -> None:
    assert not upstream_19.clean
    incident = upstream_19.findings[0]
    assert incident.kind == "foreign-read"
    assert incident.scenario.name == "over-pool"
    # The reader is the over-pool request, decoding a page another tenant wrote.
    *_, (last_event, last_state) = incident.trace
    r = last_event.req
    assert incident.scenario.requests[r].kind is Kind.OVER
    q = last_state.reqs[r]
    assert q.d == D_RUN
    foreign = [p for p in q.alloc if last_state.pages[0][p] != r]
    assert foreign and all(last_state.pages[0][p] == PRIOR for p in foreign)
    assert len(foreign) == len(q.alloc) - incident.scenario.requests[r].sent_pages


def test_incident_trace_is_the_shortest_and_replays(upstream_19: CheckResult) -> None:
    incident = upstream_19.findings[0]
    actions = [e.action for e, _ in incident.trace]
    # admit, decode admit, preallocate, bootstrap, one batch, success, commit
    assert len(actions) == 8
    assert actions[-1] == "decode_commit"
    assert "prefill_reject" not in actions and "prefill_retire" not in actions
    machine = Machine(incident.scenario, NAMED["upstream-0.5.19"].switches)
    state = initial_state(incident.scenario)
    for event, target in incident.trace:
        assert any(
            st.event == event and st.target == target
            for st in machine.successors(state)
        )
        state = target


def test_incident_trace_reads_as_numbered_events(upstream_19: CheckResult) -> None:
    text = format_finding(upstream_19.findings[0])
    lines = text.splitlines()
    assert lines[0].startswith("VIOLATION foreign-read (scenario over-pool)")
    assert "holds the KV of an earlier tenant" in lines[0]
    numbered = lines[1:]
    numbers = [re.findall(r"^\s+(\d+)\. \S", ln) for ln in numbered]
    assert numbers == [[str(n)] for n in range(1, 9)]
    assert "set_finish_with_abort" in numbered[0]
    assert any("answers 200" in ln for ln in numbered)
    assert "starts decoding" in numbered[-1]


def test_upstream_19_also_lets_the_over_pool_request_succeed(
    upstream_19: CheckResult,
) -> None:
    success = next(f for f in upstream_19.findings if f.kind == "over-pool-success")
    assert "prefill answers 200" in success.message


def test_cli_exits_1_with_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "check", check)
    result = CliRunner().invoke(model, ["check", "--config", "upstream-0.5.19"])
    assert result.exit_code == 1
    assert "VIOLATION foreign-read" in result.output
    assert re.search(r"^\s+8\. decode commits r1's transfer", result.output, re.M)
    assert "upstream-0.5.19" in result.output.splitlines()[2]
