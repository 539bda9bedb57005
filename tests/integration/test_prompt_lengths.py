"""Every tool's prompts at their exact lengths by the sandbox model's real tokenizer, counted
through an SGLang-shaped ``/tokenize``: the canary's, the soak's and the abort-storm
benchmark's, all sized by ``operations/filler.py``.

The tokenizer is the model's own (``tokenizer.json`` and ``tokenizer_config.json``, loaded by
transformers' AutoTokenizer in the 0.5.23 sandbox environment, as SGLang's ``get_tokenizer``
loads it); only the HTTP front is a stand-in (a real server is a cluster start, e2e): the
suite's ``http_stand_in`` answers ``POST /tokenize`` as SGLang 0.5.23's ``http_server.py``
(``openai_v1_tokenize``, ``OpenAIServingTokenize``) does: ``{"prompt": [text, ...]}`` in
(``add_special_tokens`` true unless sent), ``{"tokens": [[id, ...], ...], "count": [n, ...],
"max_model_len": N}`` out, each text ``tokenizer.encode(text, add_special_tokens=...)``.

Its byte-level BPE prices the words from one token to six. The canary sized its prompts by the
words' average cost (one calibration /generate): its over-pool probe for a 1024-token pool under
a 1100-token context, aimed at 1062 tokens, came out 1021, inside the pool, so a safe deployment
answered it 200 and the canary failed it. Tier: integration (the gate), no cluster. Cost: the
environment and the model are cached (the e2e tier builds both); one tokenizer process, whose
start is most of the 113 s the module took at load average 30 on the shared 2-core machine
(2026-12-06, `scripts/test tests/integration/test_prompt_lengths.py`); its tests, about 5 s."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner

from sglang_hardened.common.output import UNJUDGED
from sglang_hardened.operations.canary import SIZED, Plan, run_canary
from sglang_hardened.operations.cli import canary
from sglang_hardened.operations.filler import counter
from sglang_hardened.sandbox.cluster import ClusterParams
from sglang_hardened.sandbox.env import build_env, wheels_for
from sglang_hardened.sandbox.model import ensure_model
from sglang_hardened.sandbox.soak.catalogue import OVER, draw, fitting_lengths
from tests.harness import REPO

# docs/soak.md's sandbox: the limits the reported seeds were refused under
PARAMS = ClusterParams(base="0.5.23", prefill_pool_tokens=1024, decode_pool_tokens=2600)
KINDS = ("fits", "over-pool", "over-limit")
SEEDS = [8675309, 4242, 7, *random.Random().sample(range(1 << 30), 3)]
POOL, CONTEXT = 1024, 1100  # the incident's shape: the prefill pool under the context
ENCODER = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps(tok.model_max_length), flush=True)
for line in sys.stdin:
    texts, special = json.loads(line)
    print(json.dumps([tok.encode(t, add_special_tokens=special) for t in texts]), flush=True)
"""

Encode = Callable[[list[str], bool], list[list[int]]]


@pytest.fixture(scope="module")
def encode() -> Iterator[tuple[Encode, int]]:
    """Texts -> token ids by the sandbox model's tokenizer, in one long-lived process; and its
    model_max_length (what SGLang's /tokenize reports as max_model_len)."""
    env = build_env("0.5.23", wheels_for("0.5.23", hardened=False), REPO / "tests" / "cpu_overlay")  # cached
    lock = threading.Lock()
    with subprocess.Popen([str(env.python), "-c", ENCODER, str(ensure_model(env))], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env.environ(), cwd=REPO / "tests") as proc:
        max_len = json.loads(proc.stdout.readline())

        def ids(texts: list[str], special: bool = True) -> list[list[int]]:
            with lock:  # the stand-in answers from several threads
                proc.stdin.write(json.dumps([texts, special]) + "\n")
                proc.stdin.flush()
                return json.loads(proc.stdout.readline())
        yield ids, max_len
        proc.kill()  # its exit is slow, and nothing of it is left to read


def tokenize(encode: tuple[Encode, int], body: bytes) -> tuple[int, bytes]:
    """``POST /tokenize`` as SGLang 0.5.23 answers it."""
    ids, max_len = encode
    req = json.loads(body)
    prompt, special = req.get("prompt"), req.get("add_special_tokens", True)
    if isinstance(prompt, str):
        tokens: list = ids([prompt], special)[0]
        count: int | list[int] = len(tokens)
    elif isinstance(prompt, list):
        tokens = ids(prompt, special)
        count = [len(t) for t in tokens]
    else:
        return 400, json.dumps({"object": "error", "message": "Invalid prompt type", "type": "BadRequest",
                                "param": None, "code": 400}).encode()
    return 200, json.dumps({"tokens": tokens, "count": count, "max_model_len": max_len}).encode()


@pytest.fixture
def prefill(http_stand_in, encode) -> str:
    """An SGLang server's /tokenize, and nothing else."""
    return "http://" + http_stand_in(lambda path, body=b"": tokenize(encode, body) if path == "/tokenize"
                                     else (404, b'{"detail":"Not Found"}'))


class Deployment:
    """A safe deployment behind a gateway, as the canary sees it: /generate refuses a prompt over
    the prefill pool or at the context (4xx, as hardened prefill does), and answers the rest with
    ids hashed from the prompt and its length in ``meta_info`` (a model that never leaks).
    ``serves_tokenize``: it also answers /tokenize (an SGLang server as --url); without, a 404,
    as smg and the tool's own lb do. Every /generate's prompt length is kept."""

    def __init__(self, encode: tuple[Encode, int], serves_tokenize: bool):
        self.encode, self.serves_tokenize = encode, serves_tokenize
        self.lengths: list[tuple[str, int]] = []

    def __call__(self, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if path == "/tokenize" and self.serves_tokenize:
            return tokenize(self.encode, body)
        if path != "/generate":
            return 404, b'{"detail":"Not Found"}'
        text = json.loads(body)["text"]
        n = len(self.encode[0]([text], True)[0])
        self.lengths.append((text, n))
        if n > POOL or n >= CONTEXT:
            return 400, json.dumps({"error": {"message": f"the input ({n} tokens) is over the KV pool"}}).encode()
        ids = list(hashlib.sha256(text.encode()).digest()[:4])
        return 200, json.dumps({"text": "the", "output_ids": ids, "meta_info": {"prompt_tokens": n}}).encode()


def test_the_canary_probes_at_exactly_the_lengths_it_aims_at(http_stand_in, encode):
    """Reproduced on main: the over-pool probe came out 1021 tokens, inside the 1024-token pool,
    so this safe deployment answered it 200 and the canary failed its own check."""
    deployment = Deployment(encode, serves_tokenize=True)
    report = run_canary(f"http://{http_stand_in(deployment)}", Plan(POOL, CONTEXT, repeats=1, rounds=1))
    over_pool, tenant = POOL + (CONTEXT - POOL) // 2, min(POOL, CONTEXT) * 7 // 10
    sent = {n for text, n in deployment.lengths if "secret" not in text}
    assert sent == {over_pool, 64}, sent  # the over-pool probe between pool and context, the fitting probe
    assert {n for text, n in deployment.lengths if "secret" in text} == {tenant}
    assert report.ok, report.to_json()
    assert f"over-pool prompt ({over_pool} tokens) refused" in [c.name for c in report.checks]


def test_through_a_gateway_it_counts_with_a_server_and_names_a_gateway_that_cannot(http_stand_in, encode, prefill):
    """smg and the tool's lb serve no SGLang /tokenize: the recipe's canary names prefill's; left
    to count with the gateway, it is unjudged (exit 3), naming the gateway's URL and status."""
    gateway = f"http://{http_stand_in(Deployment(encode, serves_tokenize=False))}"
    assert run_canary(gateway, Plan(POOL, CONTEXT, repeats=1, rounds=1), tokenize_url=prefill).ok
    result = CliRunner().invoke(canary, ["--url", gateway, "--pool-tokens", str(POOL), "--context-length",
                                         str(CONTEXT), "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == UNJUDGED and report["unjudged"] and report["requests"] == 0, result.output
    (check,) = [c for c in report["checks"] if c["name"] == SIZED]
    assert check["result"] == "FAIL" and check["detail"].startswith(f"{gateway}/tokenize answered HTTP 404"), check


@pytest.mark.parametrize("answer", [
    (200, b"<html>a proxy's page</html>"),
    (200, b'{"tokens": [], "count": 7, "max_model_len": 4096}'),  # one count for a list of texts
    (200, b'{"count": [1]}'),  # fewer counts than texts
    (200, b'{"count": [1.5, "2"]}'),
    (503, b'{"error": "no available workers"}'),
], ids=["html", "scalar", "short", "not-ints", "503"])
def test_a_tokenize_that_answers_garbage_is_named_never_estimated(http_stand_in, answer):
    url = f"http://{http_stand_in(lambda path, body=b'': answer)}"
    report = run_canary(url, Plan(POOL, CONTEXT, repeats=1, rounds=1))
    assert report.unjudged and report.requests == 0, report.to_json()
    assert [c.name for c in report.checks] == [SIZED]
    assert report.checks[0].detail.startswith(f"{url}/tokenize answered HTTP {answer[0]}"), report.checks[0].detail


@pytest.mark.parametrize("seed", SEEDS)
def test_every_soak_prompt_is_its_length_by_the_real_tokenizer(prefill, encode, seed):
    """Seeds 8675309 and 4242 once stopped the soak: the average's draw went past the context."""
    count = counter(prefill)
    cat = draw(count, PARAMS, seed, KINDS)
    assert [p.tokens for p in cat.fitting] == fitting_lengths(PARAMS), seed
    assert [len(i) for i in encode[0]([p.text for p in cat.fitting], True)] == fitting_lengths(PARAMS), seed
    assert [p.tokens for p in cat.over_pool] == [PARAMS.prefill_pool_tokens + OVER]
    assert [p.tokens for p in cat.over_limit] == [PARAMS.context_length + OVER]


def test_every_abort_storm_prompt_is_its_length(prefill, encode, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as the benchmarks run: scripts in one folder
    from abort_storm import catalogue

    cat = catalogue(counter(prefill), 12, 600, seed=3)
    assert [len(i) for i in encode[0]([p.text for p in cat.fitting], True)] == [600] * 12
    assert len({p.text for p in cat.fitting}) == 12
