"""The soak's prompts, sized from the cluster (page, chunk, pool and input limit), and each
one's answer on the quiet cluster: the model a loaded, faulted cluster is checked against.

Greedy decoding maps a prompt to one output whatever else runs, so the quiet answer is
what every 200 for that prompt must be; a prompt the quiet cluster refuses must be refused.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...operations.filler import filler, tokens_per_word
from ...operations.oracle import Reply, generate
from ..cluster import ClusterParams
from ..env import SandboxError

MARGIN = 16  # tokens kept clear of a limit, for the words' measured cost being an average
OVER = 48  # tokens an over-limit prompt goes past its limit by
MAX_NEW = (4, 16)  # output tokens of a prompt (uniform, drawn with the seed)
FIT_TRIES = 8  # quiet requests a fitting prompt may take to come under its limit


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # the length it was drawn for
    max_new_tokens: int


@dataclass(frozen=True)
class Expected:
    """The quiet cluster's answer: output ids on a 200, else the error status (None: no
    answer within the bound, as upstream gives an over-pool prompt it queues for ever)."""

    status: int | None
    output_ids: tuple[int, ...] | None


@dataclass
class Catalogue:
    fitting: list[Prompt]
    over_pool: list[Prompt]
    over_limit: list[Prompt]
    expected: dict[str, Expected]  # prompt text -> its quiet answer

    def prompts(self, kind: str) -> list[Prompt]:
        return {"over-pool": self.over_pool, "over-limit": self.over_limit}.get(kind, self.fitting)


def fitting_lengths(p: ClusterParams) -> list[int]:
    """Prompt lengths on either side of a page's and a chunk's end, and spread up to the limit."""
    limit = min(p.prefill_pool_tokens, p.context_length, p.decode_context_length or p.context_length) - MAX_NEW[1] - MARGIN
    page, chunk = p.page_size, p.chunked_prefill_size or 0
    around = [n * size + d for size in (page, chunk) if size > 1 for n in (1, 2) for d in (-1, 0, 1)]
    spread = [8, 40, limit // 4, limit // 2, 3 * limit // 4, limit]
    return sorted({n for n in around + spread if 1 <= n <= limit})


def _fitted(prompt: Prompt, send: Callable[[str, int], Reply], per_word: float) -> tuple[Prompt, Reply]:
    """``prompt`` as the server counts it, with its quiet answer: the words' cost is an average
    and a seed can draw the dear ones, so a prompt drawn near the limit may come out past it
    (400); words are dropped from its end (the rest stays the same draw) until the quiet cluster
    takes it, FIT_TRIES asks at most."""
    words = prompt.text.split()
    for _ in range(FIT_TRIES):
        fitted = Prompt(" " + " ".join(words), prompt.tokens, prompt.max_new_tokens)
        reply = send(fitted.text, fitted.max_new_tokens)
        if reply.status != 400 or len(words) == 1:
            break
        words = words[:max(1, len(words) - max(1, round(MARGIN / per_word)))]
    return fitted, reply


def build(lb_url: str, params: ClusterParams, seed: int, timeout_s: float, kinds: Iterable[str]) -> Catalogue:
    """Draw the prompts ``kinds`` send and ask the quiet cluster each one, in turn."""
    def send(text: str, max_new_tokens: int = 1) -> Reply:
        try:
            return generate(lb_url, text, max_new_tokens, timeout_s)
        except TimeoutError:
            return Reply(None, None, f"no answer within {timeout_s:.0f} s", timeout_s)
        except OSError as e:
            raise SandboxError(f"the sandbox's load balancer ({lb_url}) did not answer the quiet run: {e}") from e

    per_word = tokens_per_word(send)
    rng = random.Random(f"{seed}/catalogue")

    def prompts(lengths: list[int], name: str) -> list[Prompt]:
        return [Prompt(filler(per_word, n, f"{seed}/{name}/{i}"), n, rng.randint(*MAX_NEW)) for i, n in enumerate(lengths)]

    limit = min(params.context_length, params.decode_context_length or params.context_length)
    kinds = set(kinds)
    cat = Catalogue(prompts(fitting_lengths(params), "fits"),
                    prompts([params.prefill_pool_tokens + OVER], "pool") if "over-pool" in kinds else [],
                    prompts([limit + OVER], "limit") if "over-limit" in kinds else [], {})
    answered = [_fitted(prompt, send, per_word) for prompt in cat.fitting]
    cat.fitting = [prompt for prompt, _ in answered]
    answered += [(prompt, send(prompt.text, prompt.max_new_tokens)) for prompt in cat.over_pool + cat.over_limit]
    for prompt, reply in answered:
        cat.expected[prompt.text] = Expected(reply.status, reply.output_ids)
    if refused := {p.tokens: cat.expected[p.text].status for p in cat.fitting if cat.expected[p.text].status != 200}:
        raise SandboxError(f"the quiet cluster refused fitting prompts (tokens: HTTP status) {refused}: "
                           "is the sandbox healthy?")
    return cat
