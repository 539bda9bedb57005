"""Exhaustive breadth-first search of the state graph, then liveness on it.

Safety: every reachable state is checked; breadth-first order makes the
first state found to break a property one at the end of a shortest trace.

Liveness: each check is "from every reachable state, a goal state is
reachable using only progress steps" (AG EF goal). Progress steps are all
steps except faults, and, for the prompt check, except the 300 s timeouts
as long as no node has crashed. This is equivalent to "every fair run
reaches the goal" under strong fairness of the progress steps: a step
enabled infinitely often is taken infinitely often. Faults are exempt from
fairness (bounded, never relied on); a dead end that is not a goal is a
violation too.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from .configs import SCENARIOS, Config
from .machine import FAULT, LONG, Event, Machine
from .properties import SAFETY, all_ended, no_hold, safety_violations
from .state import Scenario, State, initial_state

LIVENESS = ("requests-end", "aborts-resolve", "prompt-failure")
_ORDER = SAFETY + LIVENESS  # the order findings are reported in: the leak first

_LONG_BIT, _FAULT_BIT = 1, 2


@dataclass
class Finding:
    """A broken property and a shortest run that breaks it."""

    kind: str
    message: str
    scenario: Scenario
    trace: list[tuple[Event, State]]  # steps from the initial state
    initial: State


@dataclass
class ScenarioResult:
    scenario: Scenario
    states: int
    edges: int
    findings: list[Finding]


@dataclass
class CheckResult:
    """Outcome of one configuration over every scenario."""

    config: Config
    results: list[ScenarioResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def states(self) -> int:
        return sum(r.states for r in self.results)

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def kinds(self) -> list[str]:
        """Broken properties, each once, the leak first."""
        return sorted({f.kind for f in self.findings}, key=_ORDER.index)


class _Graph:
    """The reachable state graph of one machine, in breadth-first order."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        init = initial_state(machine.scenario)
        self.states: list[State] = [init]
        self.parent: list[int] = [-1]
        self.succ: list[list[int]] = []  # target * 4 + kind bits
        self.first: dict[str, tuple[int, str]] = {}
        self._reverse: dict[int, list[list[int]]] = {}  # per skip mask, built once
        index = {init: 0}
        states, parent, succ = self.states, self.parent, self.succ
        i = 0
        while i < len(states):
            s = states[i]
            out = []
            for step in machine.successors(s):
                t = step.target
                j = index.get(t)
                if j is None:
                    j = len(states)
                    index[t] = j
                    states.append(t)
                    parent.append(i)
                    for v in safety_violations(t, machine.scenario):
                        self.first.setdefault(v.kind, (j, v.message))
                bits = (_LONG_BIT if step.kind == LONG and not s.crashed else 0) | (
                    _FAULT_BIT if step.kind == FAULT else 0
                )
                out.append(j * 4 + bits)
            succ.append(out)
            i += 1

    @property
    def edges(self) -> int:
        return sum(len(out) for out in self.succ)

    def path_to(self, j: int, parent: list[int]) -> list[tuple[Event, State]]:
        """Replay the tree path to state ``j`` as events."""
        chain = []
        while j > 0:
            chain.append(j)
            j = parent[j]
        trace = []
        prev = self.states[0]
        for k in reversed(chain):
            target = self.states[k]
            event = next(
                st.event for st in self.machine.successors(prev) if st.target == target
            )
            trace.append((event, target))
            prev = target
        return trace

    def forward(self, skip: int) -> list[int]:
        """Parents of the states reachable along edges without ``skip`` bits
        (-2 for unreachable)."""
        parent = [-2] * len(self.states)
        parent[0] = -1
        todo = deque([0])
        while todo:
            i = todo.popleft()
            for e in self.succ[i]:
                j = e >> 2
                if not e & skip and parent[j] == -2:
                    parent[j] = i
                    todo.append(j)
        return parent

    def backward(self, goal: Callable[[State], bool], skip: int) -> bytearray:
        """States from which a goal state is reachable along edges without
        ``skip`` bits."""
        rev = self._reverse.get(skip)
        if rev is None:
            rev = self._reverse[skip] = [[] for _ in self.states]
            for i, out in enumerate(self.succ):
                for e in out:
                    if not e & skip:
                        rev[e >> 2].append(i)
        reach = bytearray(len(self.states))
        todo = deque(i for i, s in enumerate(self.states) if goal(s))
        for i in todo:
            reach[i] = 1
        while todo:
            for i in rev[todo.popleft()]:
                if not reach[i]:
                    reach[i] = 1
                    todo.append(i)
        return reach


class _Goal(NamedTuple):
    """One liveness check: reach ``goal`` without the ``skip`` edges."""

    name: str
    goal: Callable[[State], bool]
    skip: int
    why: str


def _goals(scenario: Scenario) -> list[_Goal]:
    goals = [
        _Goal(
            "requests-end",
            all_ended,
            _FAULT_BIT,
            "after this trace no fair run ends every request",
        ),
        _Goal(
            "prompt-failure",
            all_ended,
            _FAULT_BIT | _LONG_BIT,
            "after this trace no run ends every request without waiting out "
            "a 300 s timeout",
        ),
    ]
    for r in range(len(scenario.requests)):
        goals.append(
            _Goal(
                "aborts-resolve",
                no_hold(r),
                _FAULT_BIT,
                f"after this trace decode holds r{r}'s pages for ever: "
                "no ack, no release timeout",
            )
        )
    return goals


def _liveness(g: _Graph) -> list[Finding]:
    """One finding per broken liveness check.

    The state shown is, where one exists, a reachable dead end of the
    progress steps (only faults or skipped timeouts remain enabled); else the
    first state from which the goal is out of reach, inside a cycle.
    """
    found: dict[str, Finding] = {}
    scenario = g.machine.scenario
    for name, goal, skip, why in _goals(scenario):
        if name in found:
            continue
        parent = g.forward(_LONG_BIT) if skip & _LONG_BIT else g.parent
        reach = g.backward(goal, skip)
        stuck = [i for i in range(len(g.states)) if parent[i] != -2 and not reach[i]]
        if not stuck:
            continue
        dead = [i for i in stuck if all(e & skip for e in g.succ[i])]
        if dead:
            steps = g.machine.successors(g.states[dead[0]])
            waits = [
                f"{st.event.action} r{st.event.req}" for st in steps if st.kind == LONG
            ]
            also = f" and {', '.join(waits)}" if waits else ""
            at, why = dead[0], f"{why}; a dead end: only faults{also} remain enabled"
        else:
            at, why = stuck[0], f"{why}; progress steps only cycle"
        found[name] = Finding(name, why, scenario, g.path_to(at, parent), g.states[0])
    return list(found.values())


def explore(machine: Machine) -> ScenarioResult:
    """Explore a machine's whole state graph; collect every broken property."""
    # The graph is many acyclic tuples: the cyclic garbage collector would
    # only rescan them over and over while the search allocates.
    collecting = gc.isenabled()
    gc.disable()
    try:
        g = _Graph(machine)
    finally:
        if collecting:
            gc.enable()
    scenario = machine.scenario
    init = g.states[0]
    findings = [
        Finding(kind, message, scenario, g.path_to(j, g.parent), init)
        for kind, (j, message) in g.first.items()
    ]
    findings += _liveness(g)
    findings.sort(key=lambda f: _ORDER.index(f.kind))
    return ScenarioResult(scenario, len(g.states), g.edges, findings)


def check_scenario(scenario: Scenario, config: Config) -> ScenarioResult:
    """Check one scenario under one configuration."""
    return explore(Machine(scenario, config.switches, config.agreed))


def check(config: Config, scenarios: tuple[Scenario, ...] = SCENARIOS) -> CheckResult:
    """Check one configuration against every scenario of the bounds."""
    start = time.perf_counter()
    result = CheckResult(config)
    for scenario in scenarios:
        result.results.append(check_scenario(scenario, config))
    result.seconds = time.perf_counter() - start
    return result
