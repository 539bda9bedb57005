"""The one prompt sizer the soak, the canary and the abort-storm benchmark share
(``operations/filler.py``): words' costs counted once, each prompt drawn to its length and cut
from its end while the server counts it over. The tokenizers here are rules: one whose words'
costs add up (a BOS, then a word's cost differs from word to word, as the sandbox's byte-level
BPE's does) and ones whose costs do not; tests/integration/test_prompt_lengths.py runs the real
tokenizer behind an SGLang-shaped /tokenize. Tier: unit, well under a second."""

from __future__ import annotations

import pytest

from sglang_hardened.common.errors import HardenedError
from sglang_hardened.operations.filler import FIT_TRIES, WORDS, Draft, WordCosts, sized


def cost(word: str) -> int:
    return 1 + len(word) // 3  # "the" 2, "water" 2, ...: not all alike


def additive(texts: list[str]) -> list[int]:
    """A BOS and each word's own cost, as a tokenizer that splits at spaces first counts."""
    return [1 + sum(cost(w) for w in text.split()) for text in texts]


def merging(texts: list[str]) -> list[int]:
    """Each word's cost and one more for every "the" after "of": costs that do not add up."""
    return [sum(cost(w) for w in t.split()) + t.count("of the") for t in texts]


def test_the_costs_are_measured_per_word_over_the_empty_prompt():
    costs = WordCosts.measure(additive)
    assert costs.overhead == 1 and costs.words == {w: cost(w) for w in WORDS}
    assert sum(cost(w) for w in costs.draw(99, "s")) == 99
    assert costs.draw(99, "s") == costs.draw(99, "s") != costs.draw(99, "t")  # the seed's draw


def test_each_draft_is_its_length_head_and_tail_included_in_one_count_per_batch():
    asked: list[list[str]] = []

    def count(texts: list[str]) -> list[int]:
        asked.append(texts)
        return additive(texts)

    costs = WordCosts.measure(count)
    drafts = [Draft(300, "a"), Draft(120, "b", "tenant-0's secret is CANARY-1.", ". Repeat tenant-0's secret: ")]
    got = sized(count, costs, drafts)
    assert [s.tokens for s in got] == [300, 120] == additive([s.text for s in got])
    assert got[1].text.startswith(drafts[1].head + " ") and got[1].text.endswith(drafts[1].tail)
    assert len(asked) == 1 + 2  # the costs, then the framed drafts' heads and tails, then the drafts
    assert sized(additive, costs, drafts) == got  # the same seeds, the same prompts


def test_a_draw_that_counts_over_its_length_loses_words_from_its_end_until_it_does_not():
    costs = WordCosts.measure(merging)
    drafts = [Draft(150, "of"), Draft(8, "key")]
    drawn = [" ".join(costs.draw(d.tokens - costs.overhead, d.seed)) for d in drafts]
    got = sized(merging, costs, drafts)
    assert [s.tokens for s in got] == merging([s.text for s in got])
    assert all(s.tokens <= d.tokens and w.startswith(s.text.strip()) for s, d, w in zip(got, drafts, drawn))
    assert got[0].tokens > 150 * 3 // 4  # cut short, not gutted


def test_a_tokenizer_that_never_comes_down_is_refused_naming_the_lengths():
    asked: list[list[str]] = []

    def creeping(texts: list[str]) -> list[int]:  # one over, whatever comes off
        asked.append(texts)
        return [301 for _ in texts]

    with pytest.raises(HardenedError, match=r"still over their lengths after 8 counts.*\{300: 301\}"):
        sized(creeping, WordCosts.measure(additive), [Draft(300, "s")])
    assert len(asked) == FIT_TRIES


def test_a_head_and_tail_longer_than_the_draft_are_refused_not_sent():
    with pytest.raises(HardenedError, match=r"cut to 0 words at the least \(wanted: counted\) \{4: "):
        sized(additive, WordCosts.measure(additive), [Draft(4, "s", "a head of many words", "and a tail")])


@pytest.mark.parametrize("url", ["foo", "http://h:notaport"])
def test_a_url_urllib_cannot_send_to_is_an_error_naming_it_not_a_traceback(url):
    from sglang_hardened.operations.filler import token_counts

    with pytest.raises(HardenedError, match=f"{url}/tokenize"):
        token_counts(url, ["the key"])
