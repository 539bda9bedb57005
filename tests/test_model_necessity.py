"""Each hardening item is needed, or the model names the item that covers it."""

from __future__ import annotations

from functools import lru_cache

import pytest
from click.testing import CliRunner

from sglang_hardened.model import necessity
from sglang_hardened.model.checker import check
from sglang_hardened.model.cli import model
from sglang_hardened.model.configs import ALL, COVERED_BY, Switch
from sglang_hardened.model.necessity import ItemVerdict, verdict

#: What turning each uncovered item off alone breaks, and why it must.
NEEDED = {
    Switch.H4: {"prompt-failure"},  # decode waits out 300 s after prefill rejected
    Switch.H5: {
        "reuse-under-write",
        "overwritten-read",
    },  # pages freed under a live write
    Switch.H6: {"reuse-under-write"},  # the 30 s release outlives an unbounded batch
    Switch.H13: {"requests-end", "prompt-failure"},  # the gate holds a Success whose row never lands
}


_check = lru_cache(maxsize=None)(check)


@pytest.fixture(autouse=True)
def _explore_each_configuration_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(necessity, "check", _check)


@pytest.fixture(scope="module")
def verdicts() -> dict[Switch, ItemVerdict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(necessity, "check", _check)
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
        Switch.H3: ["foreign-read"],
        Switch.H8: ["foreign-read"],
    }
    for item, kinds in expected.items():
        both = verdicts[item].with_cover
        assert both is not None and both.kinds == kinds


def test_a_false_cover_claim_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # claim H5 is covered by H8: H5 off alone is not clean, so the claim fails
    monkeypatch.setitem(COVERED_BY, Switch.H5, (frozenset({Switch.H8}), "wrong"))
    assert not verdict(Switch.H5).holds


def test_cli_necessity() -> None:
    out = CliRunner().invoke(model, ["necessity"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()[1:]
    assert [ln.split(":")[0] for ln in lines] == [s.value for s in sorted(ALL)]
    assert "H4: off alone -> prompt-failure: necessary" in lines
    assert "CLAIM FAILS" not in out.output
