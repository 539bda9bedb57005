"""Prompt text of an exact number of tokens, as an SGLang server's own tokenizer counts it: the
one way the soak, the canary and the abort-storm benchmark size their prompts.

Words are drawn with a seed; what each costs is counted once by the server's ``POST /tokenize``
(every base serves it, and counts a text as ``/generate`` does), each prompt is drawn to its
length from those costs, then counted whole, and loses words from its end while it counts over.
A byte-level BPE prices these words from one token to six, so the words' average cost, which
these tools once sized by, overshot a limit or a page's end on a dear draw. There is no estimate
to fall back to: a server that does not answer a count per text is an error that names it.
"""

from __future__ import annotations

import http.client
import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..common.errors import HardenedError

# the words every filler is drawn from; what they cost in tokens is counted first
WORDS = ("the", "key", "of", "page", "door", "tree", "lamp", "book", "road", "hand", "water", "light", "house", "river")
FIT_TRIES = 8  # counts a batch may take to come down to its lengths (a tokenizer whose words' costs do not add up)
TIMEOUT_S = 60.0
ANSWER_CHARS = 300  # of a wrong answer, quoted in the error
# what a request to a server raises when there is no answer to read: refused, reset, timed out
# (OSError), a URL urllib cannot send to or a 200 that is not SGLang's (ValueError), a broken reply
NO_ANSWER = (OSError, ValueError, http.client.HTTPException)

Counter = Callable[[list[str]], list[int]]  # texts -> each one's token count, as the server counts it


def token_counts(url: str, texts: list[str], timeout: float = TIMEOUT_S) -> list[int]:
    """Each text's token count by the SGLang server at ``url``: ``POST /tokenize`` with
    ``{"prompt": [text, ...]}``, whose answer's ``count`` holds one count per text. Raises
    HardenedError naming the server and what it answered when that is not a count per text."""
    where = f"{url.rstrip('/')}/tokenize"
    try:
        req = urllib.request.Request(where, data=json.dumps({"prompt": texts}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise HardenedError(f"{where} answered HTTP {e.code}, not token counts (it must be an SGLang server's): "
                            f"{e.read().decode(errors='replace')[:ANSWER_CHARS]}") from None
    except NO_ANSWER as e:
        raise HardenedError(f"{where} did not answer: {getattr(e, 'reason', e)}") from None
    try:
        counts = json.loads(body)["count"]
    except (ValueError, KeyError, TypeError):
        counts = None
    if not (isinstance(counts, list) and len(counts) == len(texts) and all(type(n) is int and n >= 0 for n in counts)):
        raise HardenedError(f"{where} answered HTTP {status} without a count for each of the {len(texts)} texts "
                            f"(it must be an SGLang server's): {body[:ANSWER_CHARS]}")
    return counts


def counter(url: str, timeout: float = TIMEOUT_S) -> Counter:
    """``token_counts`` on the server at ``url``."""
    return lambda texts: token_counts(url, texts, timeout)


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

    def draw(self, tokens: int, seed: str) -> list[str]:
        """WORDS drawn with ``seed`` whose costs add up to ``tokens`` (short of it only where no
        word fits the last gap); the same words for the same seed and costs. Exact where a
        tokenizer splits at spaces first (byte-level BPE, SentencePiece): ``sized`` counts the
        prompt all the same."""
        rng = random.Random(seed)
        words, left = [], tokens
        while fits := [w for w in WORDS if 0 < self.words[w] <= left]:
            words.append(rng.choice(fits))
            left -= self.words[words[-1]]
        return words


@dataclass(frozen=True)
class Draft:
    """A prompt to size: ``tokens`` long as the server counts it, its filler words drawn with
    ``seed`` between a fixed ``head`` and ``tail``."""

    tokens: int
    seed: str
    head: str = ""
    tail: str = ""


@dataclass(frozen=True)
class Sized:
    text: str
    tokens: int  # its length as the server counts it: the draft's, or under it where no word fit the last gap


def sized(count: Counter, costs: WordCosts, drafts: Sequence[Draft]) -> list[Sized]:
    """Each draft's text and length by ``count``: its head and tail counted once, its filler drawn
    for the rest, the whole counted, and one counted over its length (a tokenizer whose words'
    costs do not simply add up) loses filler words from its end, the rest staying the same draw,
    and is counted again. FIT_TRIES counts at most, all the drafts in one request each time."""
    if not drafts:
        return []
    frames = list(dict.fromkeys(d.head + d.tail for d in drafts if d.head or d.tail))
    framed = {"": costs.overhead, **dict(zip(frames, count(frames) if frames else []))}
    words = [costs.draw(d.tokens - framed[d.head + d.tail], d.seed) for d in drafts]
    for tries in range(1, FIT_TRIES + 1):
        texts = [d.head + _spaced(w) + d.tail for d, w in zip(drafts, words)]
        counts = count(texts)
        if not (over := [i for i, (d, n) in enumerate(zip(drafts, counts)) if n > d.tokens]):
            return [Sized(t, n) for t, n in zip(texts, counts)]
        if any(not words[i] for i in over):
            break  # its head and tail alone are over
        for i in over:
            excess = counts[i] - drafts[i].tokens
            while excess > 0 and words[i]:
                excess -= costs.words.get(words[i].pop(), 1)
    raise HardenedError(f"prompts still over their lengths after {tries} counts, their filler cut to "
                        f"{min(len(words[i]) for i in over)} words at the least (wanted: counted) "
                        f"{ {drafts[i].tokens: counts[i] for i in over} }")


def _spaced(words: list[str]) -> str:
    return "".join(f" {w}" for w in words)
