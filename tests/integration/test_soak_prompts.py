"""The soak's prompts through the sandbox model's real tokenizer: its ``tokenizer.json``, which
the servers' fast tokenizer wraps, run by the 0.5.23 sandbox environment's ``tokenizers``. For
the seeds that once stopped the soak (8675309, 4242), the one that ran (7) and random ones,
every fitting prompt is exactly its length and every over-limit one past its limit. The
byte-level BPE's words cost one token to six, so the average's draw for 8675309 goes past the
context length: the failure the measurement replaces. The e2e soak counts with the servers'
own /tokenize. Cost: the environment and the model are cached (the e2e tier builds both);
one tokenizer process, a few seconds."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator

import pytest

from sglang_hardened.operations.filler import CALIBRATION_ROUNDS, WORDS, WordCosts, filler
from sglang_hardened.sandbox.cluster import ClusterParams
from sglang_hardened.sandbox.env import build_env, wheels_for
from sglang_hardened.sandbox.model import ensure_model
from sglang_hardened.sandbox.soak.catalogue import OVER, draw, fitting_lengths
from tests.harness import REPO

# docs/soak.md's sandbox: the limits the reported seeds were refused under
PARAMS = ClusterParams(base="0.5.23", prefill_pool_tokens=1024, decode_pool_tokens=2600)
KINDS = ("fits", "over-pool", "over-limit")
SEEDS = [8675309, 4242, 7, *random.Random().sample(range(1 << 30), 3)]
COUNTER = """
import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
for line in sys.stdin:
    print(json.dumps([len(tok.encode(t).ids) for t in json.loads(line)]), flush=True)
"""


@pytest.fixture(scope="module")
def count() -> Iterator:
    """Texts -> token counts by the sandbox model's tokenizer, in one long-lived process."""
    env = build_env("0.5.23", wheels_for("0.5.23", hardened=False), REPO / "tests" / "cpu_overlay")  # cached
    with subprocess.Popen([str(env.python), "-c", COUNTER, str(ensure_model(env))], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env.environ(), cwd=REPO / "tests") as proc:
        def counts(texts: list[str]) -> list[int]:
            proc.stdin.write(json.dumps(texts) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())
        yield counts
        proc.stdin.close()


def test_the_average_word_overshoots_the_limit_on_a_dear_draw(count):
    """Why the soak measures: 8675309's longest prompt, drawn as the soak drew it by the words'
    average cost, is over the context length itself."""
    costs = WordCosts.measure(count)
    assert min(costs.words.values()) == 1 and max(costs.words.values()) >= 5  # the words are not alike
    per_word = count([" ".join(WORDS * CALIBRATION_ROUNDS)])[0] / (len(WORDS) * CALIBRATION_ROUNDS)
    lengths = fitting_lengths(PARAMS)
    longest = filler(per_word, lengths[-1], f"8675309/fits/{len(lengths) - 1}")
    assert count([longest])[0] > PARAMS.context_length > lengths[-1]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_prompt_is_its_length_by_the_real_tokenizer(count, seed):
    cat = draw(count, PARAMS, seed, KINDS)
    assert [p.tokens for p in cat.fitting] == fitting_lengths(PARAMS), seed
    assert count([p.text for p in cat.fitting]) == fitting_lengths(PARAMS), seed
    assert [p.tokens for p in cat.over_pool] == [PARAMS.prefill_pool_tokens + OVER]
    assert [p.tokens for p in cat.over_limit] == [PARAMS.context_length + OVER]
