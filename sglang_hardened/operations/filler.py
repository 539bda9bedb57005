"""Prompt text of a given number of tokens, for any tokenizer, without loading the tokenizer:
words drawn with a seed, their token cost measured once by the server. ``filler`` aims at the
length with the words' average cost (one calibration request, through any load balancer);
``WordCosts`` hits it exactly where a server's ``/tokenize`` counts each word (a byte-level
BPE's words cost from one token to six, so an average overshoots on a dear draw)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..common.errors import HardenedError
from .oracle import Reply

# the words every filler is drawn from; what they cost in tokens is measured first
WORDS = ("the", "key", "of", "page", "door", "tree", "lamp", "book", "road", "hand", "water", "light", "house", "river")
CALIBRATION_ROUNDS = 4  # the calibration prompt is WORDS this many times over


def filler(tokens_per_word: float, tokens: int, seed: str) -> str:
    """About ``tokens`` tokens of WORDS, drawn with ``seed``: the same text for the same seed."""
    rng = random.Random(seed)
    return "".join(f" {rng.choice(WORDS)}" for _ in range(max(1, round(tokens / tokens_per_word))))


def prompt_tokens(reply: Reply) -> int:
    """The prompt's token count a /generate answer reports."""
    try:
        return int(json.loads(reply.body)["meta_info"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError):
        raise HardenedError(f"calibration request failed (HTTP {reply.status}): {reply.body[:300]}") from None


def tokens_per_word(send: Callable[[str], Reply]) -> float:
    """What one of WORDS costs in tokens on the server behind ``send`` (one request)."""
    return prompt_tokens(send(" ".join(WORDS * CALIBRATION_ROUNDS))) / (len(WORDS) * CALIBRATION_ROUNDS)


Counter = Callable[[list[str]], list[int]]  # texts -> each one's token count, as the server counts it


@dataclass(frozen=True)
class WordCosts:
    """What the server's tokenizer makes of WORDS: the tokens it adds to any prompt (a BOS), and
    each word's own cost with its leading space."""

    overhead: int
    words: Mapping[str, int]

    @classmethod
    def measure(cls, count: Counter) -> WordCosts:
        """One count of the empty prompt and of each word alone."""
        empty, *each = count(["", *(f" {w}" for w in WORDS)])
        return cls(empty, {w: n - empty for w, n in zip(WORDS, each)})

    def text(self, tokens: int, seed: str) -> str:
        """WORDS drawn with ``seed`` whose costs and the overhead add up to ``tokens`` (short of it
        only where no word fits the last gap); the same text for the same seed and costs. Exact
        where a tokenizer splits at spaces first (byte-level BPE, SentencePiece): the caller
        measures the result all the same."""
        rng = random.Random(seed)
        words, left = [], tokens - self.overhead
        while fits := [w for w in WORDS if 0 < self.words[w] <= left]:
            words.append(rng.choice(fits))
            left -= self.words[words[-1]]
        return "".join(f" {w}" for w in words)
