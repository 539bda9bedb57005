"""Prompt text of about a given number of tokens, for any tokenizer, without the tokenizer:
words drawn with a seed, their token cost measured once by a calibration request."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

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
