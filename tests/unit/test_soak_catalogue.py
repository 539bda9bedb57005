"""The soak's prompts are as long as the server counts them, whatever the seed: seeds 8675309
and 4242 once stopped the soak before it sent anything ("the quiet cluster refused fitting
prompts {992: 400}"), their draw of dear words taking the average word's cost past the limit.
The tokenizers here are rules (a word's cost differs from word to word, as the sandbox's
byte-level BPE's does, from one token to six); tests/unit/test_filler.py tests the sizing the
soak shares with the canary, and tests/integration/test_prompt_lengths.py runs the same draws
through the sandbox model's real tokenizer behind an SGLang-shaped /tokenize."""

from __future__ import annotations

import random

import pytest

from sglang_hardened.sandbox.cluster import ClusterParams
from sglang_hardened.sandbox.soak.catalogue import OVER, draw, fitting_lengths, over_lengths

PARAMS = ClusterParams(base="0.5.23", prefill_pool_tokens=1024, context_length=1024, page_size=16,
                       chunked_prefill_size=256)
KINDS = ("fits", "over-pool", "over-limit")
SEEDS = [8675309, 4242, 7, *random.Random().sample(range(1 << 30), 3)]  # random ones too: any seed must work


def cost(word: str) -> int:
    return 1 + len(word) // 3  # "the" 2, "water" 2, ...: not all alike


def additive(asked: list[list[str]]):
    """A BOS and each word's own cost, as a tokenizer that splits at spaces first counts."""
    def count(texts: list[str]) -> list[int]:
        asked.append(texts)
        return [1 + sum(cost(w) for w in text.split()) for text in texts]
    return count


@pytest.mark.parametrize("seed", SEEDS)
def test_every_prompt_is_as_long_as_drawn_for_any_seed(seed):
    asked: list[list[str]] = []
    cat = draw(additive(asked), PARAMS, seed, KINDS)
    lengths = fitting_lengths(PARAMS)
    assert [p.tokens for p in cat.fitting] == lengths, seed  # exact: pages' and chunks' ends straddled
    assert all(1 + sum(cost(w) for w in p.text.split()) == p.tokens for p in cat.fitting)
    assert [p.tokens for p in cat.over_pool] == [PARAMS.prefill_pool_tokens + OVER]
    assert [p.tokens for p in cat.over_limit] == [PARAMS.context_length + OVER]
    assert len(asked) == 4  # the words' costs once, then one count per kind
    assert draw(additive([]), PARAMS, seed, KINDS) == cat  # the same seed, the same prompts


def test_lengths_fit_every_pair_the_balancer_may_choose_and_the_over_ones_pass_every_pair():
    p = ClusterParams(base="0.5.23", prefills=2, decodes=2, prefill_limits=(600, 1024), decode_context_length=900)
    assert max(fitting_lengths(p)) == 600 - 16 - 16  # the smaller prefill's pool and context
    assert over_lengths(p) == {"over-pool": 1024 + OVER, "over-limit": 900 + OVER}  # the larger prefill with a decode
