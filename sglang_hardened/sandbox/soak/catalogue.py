"""The soak's prompts, their lengths from the cluster (page, chunk, pool and input limit) and
their text cut to those lengths by prefill's tokenizer (``operations/filler.py``), and each
one's answer on the quiet cluster: the model a loaded, faulted cluster is checked against.

Greedy decoding maps a prompt to one output whatever else runs, so the quiet answer is
what every 200 for that prompt must be; a prompt the quiet cluster refuses must be refused.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from ...common.errors import HardenedError
from ...operations.filler import Counter, Draft, WordCosts, sized
from ...operations.oracle import Reply, generate
from ..cluster import ClusterParams
from ..env import SandboxError

MARGIN = 16  # tokens kept clear of a limit: a page's rounding, a server's reserved tokens
OVER = 48  # tokens an over-limit prompt goes past its limit by
MAX_NEW = (4, 16)  # output tokens of a prompt (uniform, drawn with the seed)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # its length as the server's tokenizer counts it
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
    """Prompt lengths on either side of a page's and a chunk's end, and spread up to the limit
    every server takes (whichever pair the load balancer chooses)."""
    specs = p.specs()
    limit = min(min(s.pool_tokens, s.context_length) for s in specs) - MAX_NEW[1] - MARGIN
    page, chunk = p.page_size, p.chunked_prefill_size or 0
    around = [n * size + d for size in (page, chunk) if size > 1 for n in (1, 2) for d in (-1, 0, 1)]
    spread = [8, 40, limit // 4, limit // 2, 3 * limit // 4, limit]
    return sorted({n for n in around + spread if 1 <= n <= limit})


def over_lengths(p: ClusterParams) -> dict[str, int]:
    """The over-limit kinds' lengths, past the limit of every pair the load balancer may choose:
    the largest prefill pool, and the largest input limit of a pair (the shorter of its servers'
    context lengths)."""
    specs = p.specs()
    prefills, decodes = ([s for s in specs if s.role == role] for role in ("prefill", "decode"))
    return {"over-pool": max(s.pool_tokens for s in prefills) + OVER,
            "over-limit": max(min(a.context_length, b.context_length) for a in prefills for b in decodes) + OVER}


def draw(count: Counter, params: ClusterParams, seed: int, kinds: Iterable[str]) -> Catalogue:
    """The prompts ``kinds`` send, drawn with ``seed`` and measured with ``count`` (the server's
    tokenizer): fitting ones at exactly their lengths or under, over-limit ones past their limit."""
    costs = WordCosts.measure(count)
    rng = random.Random(f"{seed}/catalogue")

    def prompts(lengths: list[int], name: str) -> list[Prompt]:
        texts = sized(count, costs, [Draft(n, f"{seed}/{name}/{i}") for i, n in enumerate(lengths)])
        return [Prompt(t.text, t.tokens, rng.randint(*MAX_NEW)) for t in texts]

    over = over_lengths(params)
    kinds = set(kinds)
    cat = Catalogue(prompts(fitting_lengths(params), "fits"),
                    prompts([over["over-pool"]], "pool") if "over-pool" in kinds else [],
                    prompts([over["over-limit"]], "limit") if "over-limit" in kinds else [], {})
    if short := {p.tokens: over[kind] - OVER for kind in over for p in cat.prompts(kind) if p.tokens <= over[kind] - OVER}:
        raise SandboxError(f"prompts meant to be over a limit came out within it (tokens: limit) {short}")
    return cat


def build(lb_url: str, count: Counter, params: ClusterParams, seed: int, timeout_s: float,
          kinds: Iterable[str]) -> Catalogue:
    """``draw`` the prompts, then ask the quiet cluster each one, in turn."""
    try:
        cat = draw(count, params, seed, kinds)
    except HardenedError as e:
        raise SandboxError(f"the sandbox's prefill did not size the soak's prompts: {e}") from e
    for prompt in cat.fitting + cat.over_pool + cat.over_limit:
        try:
            reply = generate(lb_url, prompt.text, prompt.max_new_tokens, timeout_s)
        except TimeoutError:
            reply = Reply(None, None, f"no answer within {timeout_s:.0f} s", timeout_s)
        except OSError as e:
            raise SandboxError(f"the sandbox's load balancer ({lb_url}) did not answer the quiet run: {e}") from e
        cat.expected[prompt.text] = Expected(reply.status, reply.output_ids)
    if refused := {p.tokens: cat.expected[p.text].status for p in cat.fitting if cat.expected[p.text].status != 200}:
        raise SandboxError(f"the quiet cluster refused fitting prompts (tokens: HTTP status) {refused}: "
                           "is the sandbox healthy?")
    return cat
