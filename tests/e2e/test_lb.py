"""`sglang-hardened lb` on real upstream 0.5.23 servers, beside mini-lb on the same cluster.

0.5.23 rejects a prompt over the prefill pool at once with a 400; mini-lb returns decode's
status, so its client waits out decode's waiting timeout. Ours returns prefill's 400 at once
and aborts decode's half, which must leave decode free for the next request.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from sglang_hardened.operations.oracle import generate

from .conftest import sandbox_env
from .scenarios import FITTING_C, OVERSIZED_B, TIMEOUT_PARAMS, before_decode_gives_up

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.23", False, TIMEOUT_PARAMS)


@pytest.fixture
def hardened_lb(shared_cluster) -> str:
    return shared_cluster.add_lb("hardened", sandbox_env("0.5.23"))


@pytest.mark.claim("H9", "upstream")
@pytest.mark.claim("H9", "hardened")
def test_prefill_400_reaches_the_client_at_once_through_ours_not_through_mini_lb(shared_cluster, hardened_lb):
    waiting = shared_cluster.params.waiting_timeout_s
    ours = generate(hardened_lb, OVERSIZED_B, timeout=120)
    assert ours.status == 400 and before_decode_gives_up(shared_cluster, ours), (ours.status, ours.seconds, ours.body[:300])
    assert "error" in json.loads(ours.body), ours.body  # prefill's own error body
    # decode's half was aborted, not left holding the request: the next one is served at once
    after = generate(hardened_lb, FITTING_C, timeout=120)
    assert after.status == 200 and before_decode_gives_up(shared_cluster, after), (after.status, after.seconds)
    theirs = shared_cluster.generate(OVERSIZED_B, timeout=waiting * 4 + 60)
    assert theirs.seconds >= waiting and theirs.body != ours.body, (theirs.status, theirs.seconds, theirs.body[:300])


def _post(url: str, payload: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as reply:
        return reply.read().decode()


def test_same_answers_as_mini_lb_plain_streamed_and_openai(shared_cluster, hardened_lb):
    ours, theirs = generate(hardened_lb, FITTING_C), shared_cluster.generate(FITTING_C)
    assert ours.status == theirs.status == 200 and ours.output_ids == theirs.output_ids
    payload = {"text": FITTING_C, "stream": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    events = [line[5:].strip() for line in _post(f"{hardened_lb}/generate", payload).splitlines()
              if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["output_ids"] for e in events[:-1]]
    assert list(ours.output_ids) in (chunks[-1], [i for c in chunks for i in c])  # cumulative or incremental
    completion = {"prompt": FITTING_C, "max_tokens": 4, "temperature": 0.0}
    ours_text, theirs_text = (json.loads(_post(f"{url}/v1/completions", completion))["choices"][0]["text"]
                              for url in (hardened_lb, shared_cluster.lb_url))
    assert ours_text == theirs_text
