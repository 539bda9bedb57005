"""The suite's pytest plugin: tiers, the claims guard, phase timing and the budget.

Registered by ``tests/conftest.py`` (``pytest_plugins``); test modules import its helpers
(``phase``, ``eventually``, ``REPO``) from here, never from a conftest module.

Tiers (docs/testing.md): ``tests/unit`` (pure), ``tests/integration`` (wheels, venvs, real
transports, the image) and ``tests/e2e`` (real PD clusters). ``--tier gate`` is the landing gate
(`.ci/run`): every unit test, the integration tests not marked ``full``, and the e2e tests that
carry a claim (``@pytest.mark.claim(id, side)``) or the ``gate`` marker; it ends with the claims
table and fails with ``CLAIM NOT SHOWN Hn`` for a hardening id whose upstream-failing test or
hardened twin did not pass. ``--tier full`` runs everything. Either tier, run whole, is held to its
table of ``tests/budget.toml``.
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from hypothesis import settings

from sglang_hardened.common.knobs import SUITE_STARTED
from sglang_hardened.common.table import format_table

REPO = Path(__file__).resolve().parent.parent
BUDGET_FILE = Path(__file__).with_name("budget.toml")
CATALOGUE = REPO / "patches" / "hardening.toml"  # the hardening ids, one table each
TIERS = ("gate", "full")
SIDES = ("upstream", "hardened")

# Property tests: the gate's examples, and more each night (HYPOTHESIS_PROFILE=nightly, the workflow).
settings.register_profile("gate", max_examples=100, deadline=None)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gate"))


# --- the budget ---

@dataclass(frozen=True)
class Spent:
    """What a run used, in the units of tests/budget.toml."""

    run_seconds: float
    setup_seconds: float
    cluster_starts: int
    server_restarts: int


def load_budget(tier: str, path: Path = BUDGET_FILE) -> Spent:
    """The ``[tier]`` table of the budget file, which must have exactly Spent's lines."""
    data = tomllib.loads(path.read_text())
    if tier not in data:
        raise ValueError(f"{path}: has no [{tier}] table (tiers: {sorted(data)})")
    names = {f.name for f in fields(Spent)}
    if set(data[tier]) != names:
        raise ValueError(f"{path} [{tier}]: wants exactly {sorted(names)}, has {sorted(data[tier])}")
    return Spent(**data[tier])


def overruns(spent: Spent, budget: Spent) -> list[str]:
    """One line per budget line ``spent`` exceeds (none: within budget)."""
    return [f"{f.name}: {getattr(spent, f.name):g} over the budget of {getattr(budget, f.name):g} ({BUDGET_FILE.name})"
            for f in fields(Spent) if getattr(spent, f.name) > getattr(budget, f.name)]


# --- phases: what a run spends its time on ---

TIMINGS: list[tuple[str, float]] = []
# Phase kinds (a phase's name starts with its kind): building sandbox environments, which a warm
# cache skips, and the starts the budget counts.
SETUP_KINDS = ("wheels", "env", "model")
CLUSTER_START, SERVER_RESTART = "cluster start", "server restart"
MODULE_SECONDS: dict[str, float] = {}
SESSION: list[pytest.Session] = []  # the running session, whose exit status an overrun fails
SUITE_STARTED = os.environ.pop(SUITE_STARTED.name, None)  # read once: a pytest a test starts is no whole run


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time a phase of the run for the summary printed at the end."""
    start = time.monotonic()
    try:
        yield
    finally:
        TIMINGS.append((name, time.monotonic() - start))


def eventually(pred, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    """Whether ``pred()`` turns true within ``timeout_s`` (polled): for state another thread or
    process changes."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def _kind(name: str) -> str:
    return next((k for k in (CLUSTER_START, SERVER_RESTART, *SETUP_KINDS) if name.startswith(k)), name.split()[0])


def spent(run_seconds: float) -> Spent:
    """This run's use of the budget, from its phases."""
    return Spent(run_seconds=round(run_seconds), setup_seconds=round(sum(s for n, s in TIMINGS if _kind(n) in SETUP_KINDS)),
                 cluster_starts=sum(_kind(n) == CLUSTER_START for n, _ in TIMINGS),
                 server_restarts=sum(_kind(n) == SERVER_RESTART for n, _ in TIMINGS))


# --- claims: every hardening id shown failing upstream and holding hardened ---

def catalogue(path: Path = CATALOGUE) -> list[str]:
    """The hardening ids, in the catalogue's order."""
    return list(tomllib.loads(path.read_text()))


def claims_of(item: pytest.Item) -> list[tuple[str, str]]:
    """The (id, side) pairs a test shows: ``@pytest.mark.claim("H3", "upstream")``, optionally
    ``params=[...]`` naming the parametrizations (pytest's ids) it is made for."""
    found = []
    callspec = getattr(item, "callspec", None)
    for mark in item.iter_markers("claim"):
        hid, side = mark.args
        if side not in SIDES or not re.fullmatch(r"H\d+", hid):
            raise pytest.UsageError(f"{item.nodeid}: claim({hid!r}, {side!r}): want an id Hn and a side in {SIDES}")
        params = mark.kwargs.get("params")
        if params is None or (callspec is not None and callspec.id in params):
            found.append((hid, side))
    return found


PASSED: dict[str, bool] = {}  # nodeid -> every phase passed (a failing teardown un-shows it)
CLAIMED: dict[tuple[str, str], list[str]] = {}  # (id, side) -> node ids selected for it


def claims_table() -> tuple[list[tuple[str, str, str]], list[str]]:
    """Rows (id, upstream test, hardened test) and the ids missing a passed side."""
    rows, missing = [], []
    for hid in catalogue():
        shown = []
        for side in SIDES:
            passed = [n for n in CLAIMED.get((hid, side), []) if PASSED.get(n)]
            shown.append(passed[0] + (f" (+{len(passed) - 1})" if len(passed) > 1 else "") if passed else "NOT SHOWN")
        rows.append((hid, *shown))
        if "NOT SHOWN" in shown:
            missing.append(hid)
    return rows, missing


# --- options, selection and shards ---

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sglang-hardened")
    group.addoption("--tier", choices=TIERS, help="gate: what .ci/run lands on (claims guarded); full: everything")
    group.addoption("--shard", metavar="K/N", help="run only the K-th of N shards (test modules dealt round-robin)")
    group.addoption("--report-dir", metavar="DIR", help="also write the per-phase, per-module and claims tables here")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "claim(id, side, params=None): shows hardening id on side upstream|hardened")
    config.addinivalue_line("markers", "gate: an e2e test the landing gate runs though it carries no claim")
    config.addinivalue_line("markers", "full: an integration test only the full run runs")


def in_gate(item: pytest.Item) -> bool:
    """Whether the landing gate runs this test (the tier is the folder it lives in)."""
    path = Path(str(item.fspath))
    if path.is_relative_to(REPO / "tests" / "e2e"):
        return bool(claims_of(item)) or item.get_closest_marker("gate") is not None
    return item.get_closest_marker("full") is None


def _shard(spec: str) -> tuple[int, int]:
    try:
        k, n = map(int, spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {spec!r}: want K/N, e.g. 2/4") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec!r}: K must be 1..N")
    return k, n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Select the tier and shard; the real clusters run last, in their own order: the tests before
    them run while tests/e2e/conftest.py builds the clusters' environments in the background."""
    keep = list(items)
    if config.getoption("tier") == "gate":
        keep = [i for i in keep if in_gate(i)]
    if spec := config.getoption("shard"):
        k, n = _shard(spec)
        modules = sorted({i.nodeid.split("::")[0] for i in keep})
        mine = set(modules[k - 1::n])
        keep = [i for i in keep if i.nodeid.split("::")[0] in mine]
    if dropped := [i for i in items if i not in set(keep)]:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The claims of the tests that will run: after every deselection (-k, -m, --lf included)."""
    for item in session.items:
        for claim in claims_of(item):
            CLAIMED.setdefault(claim, []).append(item.nodeid)


# --- reporting ---

def pytest_sessionstart(session: pytest.Session) -> None:
    SESSION.append(session)


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::")[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration
    ok = report.passed and not hasattr(report, "wasxfail")  # an xfail that passed shows nothing
    if report.when == "call" or not ok:
        PASSED[report.nodeid] = ok and PASSED.get(report.nodeid, True)


def _whole_run(config: pytest.Config) -> str | None:
    """The tier this run is held to: a whole tier that scripts/test started, not a shard."""
    tier = config.getoption("tier")
    return tier if tier and SUITE_STARTED and not config.getoption("shard") else None


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    write, sections = terminalreporter.write_line, {}
    if TIMINGS:
        kinds: dict[str, list[float]] = {}
        for name, seconds in TIMINGS:
            kinds.setdefault(_kind(name), []).append(seconds)
        sections["per-phase times"] = "\n".join(f"{s:8.1f}s  {n}" for n, s in TIMINGS) + "\n\n" + format_table(
            ("phase kind", "count", "seconds"),
            [(k, str(len(v)), f"{sum(v):.0f}") for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))])
    if MODULE_SECONDS:
        sections["per-module times (setup, call, teardown)"] = format_table(("module", "seconds"), [
            (m, f"{s:.0f}") for m, s in sorted(MODULE_SECONDS.items(), key=lambda kv: -kv[1]) if s >= 1.0])
    tier, failures = _whole_run(config), []
    if CLAIMED and (tier or any(n in PASSED for ids in CLAIMED.values() for n in ids)):
        rows, missing = claims_table()
        sections["claims (patches/hardening.toml): upstream fails, hardened holds"] = format_table(
            ("id", "upstream-failing test", "hardened test"), rows)
        if tier:
            failures += [f"CLAIM NOT SHOWN {hid}" for hid in missing]
    elif tier:
        failures += [f"CLAIM NOT SHOWN {hid}" for hid in catalogue()]
    if tier:
        used, budget = spent(time.time() - float(SUITE_STARTED)), load_budget(tier)
        sections[f"budget (tests/budget.toml [{tier}])"] = format_table(("line", "spent", "budget"), [
            (f.name, f"{getattr(used, f.name):g}", f"{getattr(budget, f.name):g}") for f in fields(Spent)])
        failures += [f"OVER BUDGET {line}" for line in overruns(used, budget)]
    for title, text in sections.items():
        terminalreporter.section(title)
        write(text)
    for line in failures:
        write(line, red=True, bold=True)
    if failures:
        SESSION[0].exitstatus = pytest.ExitCode.TESTS_FAILED
    if out := config.getoption("report_dir"):
        _write_report(Path(out), sections, failures)


def _write_report(out: Path, sections: dict[str, str], failures: list[str]) -> None:
    """The run's tables as files (the workflow keeps them as an artifact)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.txt").write_text("".join(f"== {t}\n{s}\n\n" for t, s in sections.items()) + "\n".join(failures))
    (out / "run.json").write_text(json.dumps({
        "phases": TIMINGS, "modules": MODULE_SECONDS, "failures": failures,
        "claims": {f"{h} {s}": [n for n in ids if PASSED.get(n)] for (h, s), ids in sorted(CLAIMED.items())},
    }, indent=1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that started sandbox clusters gets each server's log tail."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for c in getattr(item, "sandbox_clusters", []):
            rep.sections.append((f"sandbox {c.params.base} logs", c.log_tails(60)))
