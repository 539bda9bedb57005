"""Every named configuration gives the result its release says it should.

Hardened configurations must be clean within the bounds; each upstream
release must break exactly the properties its named configuration leaves open.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sglang_hardened.model import cli
from sglang_hardened.model.checker import CheckResult, check_scenario
from sglang_hardened.model.checker import check as uncached_check
from sglang_hardened.model.cli import model
from sglang_hardened.model.configs import (
    ALL,
    NAMED,
    SCENARIOS,
    WIDE_SCENARIOS,
    Switch,
    parse_config,
)
from tests.unit.model_results import check

HARDENED = [n for n in NAMED if n.startswith("hardened-")]

#: What every upstream release leaves open: other tenants' pages read (the incident's and
#: truncation's unwritten pages, pages reused under a live write, a write reported done that
#: never landed: no H8), decode waiting out its timeout, and a request whose metadata row
#: never lands held for ever (requests-end: no H13).
_LEAKS = {"foreign-read", "overwritten-read", "reuse-under-write", "prompt-failure", "requests-end"}
#: What each upstream release leaves open, in the model's terms.
UPSTREAM_OPEN = {
    # the incident itself: an over-pool request gets a 200
    "upstream-0.5.19": _LEAKS | {"over-pool-success"},
    # no success for over-pool any more, but decode waits out its timeout
    "upstream-0.5.20": _LEAKS,
    # deferred release on, but the 30 s timeout still frees pages under an unbounded batch;
    # truncation still reads stale pages; with two ranks each decode rank frees a hold on
    # its own ack or deadline, and the ranks part ways (the hold then never resolves)
    "upstream-0.5.21": _LEAKS | {"ranks-diverge", "aborts-resolve"},
    "upstream-0.5.22": _LEAKS | {"ranks-diverge", "aborts-resolve"},
    # 0.5.23 all-reduces its deferred releases
    "upstream-0.5.23": _LEAKS,
}


@pytest.fixture(autouse=True)
def _cli_shares_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "check", check)


@pytest.fixture(scope="module")
def results() -> dict[str, CheckResult]:
    return {name: check(cfg, SCENARIOS) for name, cfg in NAMED.items()}


def test_names_cover_every_base_twice() -> None:
    bases = ["0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
    assert sorted(NAMED) == sorted(
        [f"upstream-{b}" for b in bases] + [f"hardened-{b}" for b in bases]
    )
    assert all(NAMED[n].switches == ALL for n in HARDENED)


@pytest.mark.parametrize("name", HARDENED)
def test_hardened_is_clean(results: dict[str, CheckResult], name: str) -> None:
    res = results[name]
    assert res.clean, [f.kind for f in res.findings]
    assert len(res.results) == len(SCENARIOS)
    assert all(r.states > 1000 for r in res.results)


@pytest.mark.parametrize("name", sorted(UPSTREAM_OPEN))
def test_upstream_breaks_what_it_leaves_open(
    results: dict[str, CheckResult], name: str
) -> None:
    assert set(results[name].kinds) == UPSTREAM_OPEN[name]


@pytest.mark.parametrize("name", list(NAMED))
def test_requests_end_and_aborts_resolve_but_for_metadata_that_never_lands(
    results: dict[str, CheckResult], name: str
) -> None:
    """Everywhere, but upstream's metadata gate holds a Success whose row never lands for
    ever (sgl-project/sglang#31800's slot leak): that is upstream's one request that does not end, bar
    servers whose ranks have parted ways."""
    res = results[name]
    stuck = [f for f in res.findings if f.kind in ("requests-end", "aborts-resolve")]
    if name in HARDENED:
        assert not stuck
    else:
        assert any(f.kind == "requests-end" for f in stuck)
        for f in stuck:
            last = f.trace[-1][1]
            assert last.diverged or any(e.action == "metadata_lost" for e, _ in f.trace)


def test_hardened_is_clean_with_three_tenants_on_four_pages() -> None:
    (three,) = [sc for sc in WIDE_SCENARIOS if sc.name == "three-tenants"]
    assert len(three.requests) == 3
    res = check_scenario(three, NAMED["hardened-0.5.23"])
    assert res.findings == [] and res.states > 100_000


def test_truncation_still_leaks_on_0_5_23(results: dict[str, CheckResult]) -> None:
    leak = next(
        f for f in results["upstream-0.5.23"].findings if f.kind == "foreign-read"
    )
    assert leak.scenario.name == "truncation"
    assert "its transfer never wrote (2 of 3 pages sent)" in leak.message


def test_exploration_is_deterministic() -> None:
    cfg = NAMED["hardened-0.5.23"]
    first, again = check(cfg), uncached_check(cfg)
    assert [r.states for r in first.results] == [r.states for r in again.results]
    assert [r.edges for r in first.results] == [r.edges for r in again.results]


def test_explicit_switch_lists() -> None:
    assert parse_config("h1, H5").switches == {Switch.H1, Switch.H5}
    assert parse_config("none").switches == frozenset()
    assert parse_config(",".join(s.value for s in ALL)).expect_clean
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_config("H7")
    # the 0.5.19 switches spelled out give the 0.5.19 result
    assert check(parse_config("none")).kinds == check(NAMED["upstream-0.5.19"]).kinds


def test_cli_list_and_table() -> None:
    runner = CliRunner()
    listed = runner.invoke(model, ["check", "--list"])
    assert listed.exit_code == 0
    assert len(listed.output.splitlines()) == len(NAMED)
    assert "hardened-0.5.21  H1,H2,H3,H4,H5,H6,H8,H13" in listed.output
    clean = runner.invoke(model, ["check", "--config", "hardened-0.5.23"])
    assert clean.exit_code == 0, clean.output
    header, row = clean.output.splitlines()[1:3]
    assert header.split() == ["config", "states", "result", "seconds"]
    assert row.split()[0] == "hardened-0.5.23" and row.split()[2] == "clean"
    assert int(row.split()[1]) == check(NAMED["hardened-0.5.23"]).states


def test_cli_all_checks_expectations() -> None:
    out = CliRunner().invoke(model, ["check", "--all"])
    assert out.exit_code == 0, out.output
    assert "every configuration gives its expected result" in out.output
    assert (
        sum(
            1
            for ln in out.output.splitlines()
            if ln.startswith(("upstream-", "hardened-"))
        )
        == 10
    )


def test_cli_usage_errors() -> None:
    runner = CliRunner()
    assert runner.invoke(model, ["check"]).exit_code == 2
    bad = runner.invoke(model, ["check", "--config", "upstream-0.4"])
    assert bad.exit_code == 2 and "unknown configuration" in bad.output


@pytest.mark.parametrize("args", [[], ["check"], ["necessity"]])
def test_every_command_has_help_with_an_example(args: list[str]) -> None:
    out = CliRunner().invoke(model, [*args, "--help"])
    assert out.exit_code == 0
    assert "Example" in out.output and "sglang-hardened model" in out.output
