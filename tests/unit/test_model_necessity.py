"""Each hardening item is needed, or the model names the item that covers it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sglang_hardened.model import necessity
from sglang_hardened.model.cli import model
from sglang_hardened.model.configs import ALL, COVERED_BY, Agreement, Switch
from sglang_hardened.model.necessity import ItemVerdict, agreement_verdict, kinds_at, verdict
from tests.unit.model_results import check

#: What turning each uncovered item off alone breaks, and why it must.
NEEDED = {
    Switch.H4: {"prompt-failure"},  # decode waits out 300 s after prefill rejected
    Switch.H5: {
        "reuse-under-write",
        "overwritten-read",
    },  # pages freed under a live write
    Switch.H6: {"reuse-under-write"},  # the 30 s release outlives an unbounded batch
    Switch.H8: {"overwritten-read"},  # a write reported done that never landed is read
    Switch.H13: {"requests-end", "prompt-failure"},  # the gate holds a Success whose row never lands
}




@pytest.fixture(autouse=True)
def _explore_each_configuration_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(necessity, "check", check)


@pytest.fixture(scope="module")
def verdicts() -> dict[Switch, ItemVerdict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(necessity, "check", check)
        return {item: verdict(item) for item in sorted(ALL)}


def test_every_item_is_needed_or_covered() -> None:
    assert set(NEEDED) | set(COVERED_BY) == ALL
    assert not set(NEEDED) & set(COVERED_BY)


@pytest.mark.parametrize("item", sorted(NEEDED))
def test_needed_item_off_alone_breaks_the_model(
    verdicts: dict[Switch, ItemVerdict], item: Switch
) -> None:
    v = verdicts[item]
    assert v.holds and v.with_cover is None
    assert set(v.alone.kinds) == NEEDED[item]


@pytest.mark.parametrize("item", sorted(COVERED_BY))
def test_covered_item_is_covered(
    verdicts: dict[Switch, ItemVerdict], item: Switch
) -> None:
    v = verdicts[item]
    assert v.alone.clean, v.alone.kinds
    assert v.with_cover is not None and not v.with_cover.clean
    assert v.holds and v.reason


def test_covers_break_the_property_they_stand_for(
    verdicts: dict[Switch, ItemVerdict],
) -> None:
    # admission (H1/H2) guards the success property; coverage and tags
    # (H3/H8) guard reads
    expected = {
        Switch.H1: ["over-pool-success"],
        Switch.H2: ["over-pool-success"],
        Switch.H3: ["foreign-read", "overwritten-read"],
    }
    for item, kinds in expected.items():
        both = verdicts[item].with_cover
        assert both is not None and both.kinds == kinds


def test_a_false_cover_claim_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # claim H5 is covered by H8: H5 off alone is not clean, so the claim fails
    monkeypatch.setitem(COVERED_BY, Switch.H5, (frozenset({Switch.H8}), "wrong"))
    assert not verdict(Switch.H5).holds


@pytest.mark.parametrize("agreement", list(Agreement))
def test_agreements_are_what_a_second_rank_makes_necessary(agreement: Agreement) -> None:
    v = agreement_verdict(agreement)
    assert v.holds
    assert not kinds_at(v.alone, 1)
    assert kinds_at(v.alone, 2)[0] == "ranks-diverge"


def test_cli_necessity() -> None:
    out = CliRunner().invoke(model, ["necessity"])
    assert out.exit_code == 0, out.output
    rows = [ln.split() for ln in out.output.splitlines()[3:]]
    names = [s.value for s in sorted(ALL)] + [a.value for a in Agreement]
    assert [row[0] for row in rows[: len(names)]] == names
    assert ["H4", "prompt-failure", "prompt-failure", "necessary"] in rows
    assert "CLAIM FAILS" not in out.output
