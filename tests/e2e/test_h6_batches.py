"""H6 on real servers: a transfer with more entries than one Mooncake TCP call accepts.

The deep sandbox model (1600 layers) makes every chunk's transfer 2 x 1600
entries per run of pages, over Mooncake TCP's ~2,050 per call with default
settings, whatever the prompt: upstream sends it as one call and the request
fails; a hardened build splits it into bounded calls and serves it. Servers
are started as the sandbox does, without `sglang-hardened launch`: the bound
holds from the policy file's defaults alone. The page ledger records every
Mooncake engine call (what it carried, below every split), so the splits are
observed, not taken from the servers' logs: upstream's index batches
(``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``, 0.5.20 on; 0.5.19 ignores it, its
hardened build carries the backport) and H6's entry bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from sglang_hardened.operations.oracle import Reply
from sglang_hardened.runtime.transfer_bounds import bounds_from
from sglang_hardened.sandbox.ledger import Ledger, wait_for, writer
from sglang_hardened.sandbox.model import DEEP

from .conftest import sandbox_env
from .scenarios import FULL_MATRIX

pytestmark = pytest.mark.e2e

# page_size 1; pools hold the context on both roles (hardened builds refuse less), and decode's
# also holds the prompt plus its 512-token reserve (else decode never admits it).
PARAMS = dict(prefill_pool_tokens=1024, decode_pool_tokens=2048, context_length=1024, page_size=1,
              waiting_timeout_s=60)
PROMPT = "page cache token key of the " * 100  # 600 tokens: fits both pools
REJECTED = "TCP lane queue-full rejection"
INDEX_BATCH = 256  # pages per index batch, set low so the prompt spans three
INDEX_BATCH_ENV = f"SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES={INDEX_BATCH}"


def start(start_cluster, env, tmp_path, **params):
    return start_cluster(env, model="deep", **PARAMS, **params,
                         extra_env=(INDEX_BATCH_ENV, f"{writer.DIR_ENV}={tmp_path}"))


@dataclass
class Sent:
    """The prompt's reply and its Mooncake engine calls, from the page ledger: ``run`` is its
    longest run of pages contiguous on both roles (what one entry would cover unsplit),
    ``entry`` the most pages one entry covered (its bytes over what one page holds in one
    layer's K or V: the write's bytes over its pages x 2 x layers)."""

    reply: Reply
    calls: list[dict]
    run: int
    entry: float


def send(cluster, tmp_path) -> Sent:
    sent_at = time.monotonic()
    reply = cluster.generate(PROMPT, timeout=300)
    room = wait_for(tmp_path, "begin", after=sent_at)["room"]
    ledger = Ledger(tmp_path)
    sent = Sent(reply, ledger.calls(room), 0, 0.0)
    for begin in (b for b in ledger.of("begin") if b["room"] == room):
        mine = [c for c in sent.calls if c["w"] == begin["w"]]
        assert mine, f"write {begin['w']} of room {room}: no engine call recorded (the ledger's wrap did not apply)"
        page_bytes = sum(c["bytes"] for c in mine) / (len(begin["pages"]) * 2 * DEEP["num_hidden_layers"])
        sent.entry = max([sent.entry, *(c["longest"] / page_bytes for c in mine)])
        sent.run = max(sent.run, longest_run(begin["src"], begin["pages"]))
    print(f"\nroom {room}: {len(sent.calls)} engine calls of {sorted({c['entries'] for c in sent.calls})} entries; "
          f"longest run {sent.run} pages, one entry covered at most {sent.entry:.0f}")
    return sent


def longest_run(src: list[int], dst: list[int]) -> int:
    run = best = 1
    for i in range(1, len(src)):
        run = run + 1 if (src[i], dst[i]) == (src[i - 1] + 1, dst[i - 1] + 1) else 1
        best = max(best, run)
    return best


@pytest.mark.claim("H6", "upstream", params=["0.5.19"])
# Upstream 0.5.19 shows both in CI: no index split (it lacks 0.5.20's) and the failed call;
# 0.5.23 splits into index batches, and each still carries 2 x 1600 entries: it fails the same way.
@pytest.mark.parametrize("base", ["0.5.19", "0.5.23"] if FULL_MATRIX else ["0.5.19"])
def test_upstream_fails_a_transfer_over_the_tcp_per_call_limit(base, start_cluster, tmp_path):
    cluster = start(start_cluster, sandbox_env(base), tmp_path, probe_transfer=False)
    sent = send(cluster, tmp_path)
    assert sent.reply.status != 200, sent.reply.body[:500]
    assert REJECTED in cluster.log_tail("prefill", 400)
    assert any(c["entries"] > bounds_from({}).max_entries and c["rc"] != 0 for c in sent.calls), sent.calls
    if base == "0.5.19":
        assert sent.run > INDEX_BATCH, "the prompt's pages were not contiguous: nothing for a split to show"
        assert sent.entry == pytest.approx(sent.run), "upstream 0.5.19 sends each run in one entry: no index split"


@pytest.mark.claim("H6", "hardened", params=["0.5.19"])
# CI: 0.5.19, whose split is the backport; 0.5.23's bounds in CI are test_h6_mooncake_tcp's.
@pytest.mark.parametrize("base", ["0.5.19", "0.5.23"] if FULL_MATRIX else ["0.5.19"])
def test_hardened_serves_it_in_bounded_calls(base, start_cluster, tmp_path):
    cluster = start(start_cluster, sandbox_env(base, hardened=True), tmp_path)  # ready = served
    sent = send(cluster, tmp_path)
    assert sent.reply.status == 200, sent.reply.body[:500]
    bounds = bounds_from({})
    assert all(c["entries"] <= bounds.max_entries and c["bytes"] <= bounds.max_bytes and c["rc"] == 0
               for c in sent.calls), sent.calls
    assert sent.run > INDEX_BATCH, "the prompt's pages were not contiguous: nothing for a split to show"
    assert sent.entry <= INDEX_BATCH, "a run went in one entry: no index split"  # 0.5.19: the backport
    prefill_log = cluster.log_tail("prefill", 400)
    assert (f"sglang-hardened H6: each Mooncake transfer call carries at most {bounds.max_entries} entries "
            f"and {bounds.max_bytes} bytes") in prefill_log
    assert REJECTED not in prefill_log
