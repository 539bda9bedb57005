"""H5 under an abort storm, on a cluster bench_serving_ab.py has started: capacity while clients
hang up mid-request and the hardened build holds their pages until every write into them ends.

For each abort share: --storm-requests requests of exactly --storm-tokens tokens (prefill's
/tokenize cuts each to length, as the soak's and the canary's prompts) at
--storm-concurrency through the load balancer, the same seeded schedule for every arm of a
pair; each request's client hangs up, with the share's probability, between HANG_UP_S after
sending (while prefill computes or the transfer runs, on the CPU rig). What the requests the
schedule kept get: requests/s (their 200s over the storm's wall time), p99 latency (with 100
or fewer, the slowest), and any answer that was not a 200. After the storms the cluster must
serve a request again: a hold that never ended would leave its pages out of the pool.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from stats import quantile  # benchmarks/ is on sys.path when run as a script

from sglang_hardened.operations.filler import Counter, Draft, WordCosts, counter, sized
from sglang_hardened.sandbox.cluster import Cluster
from sglang_hardened.sandbox.soak.catalogue import Catalogue, Prompt
from sglang_hardened.sandbox.soak.plan import Step
from sglang_hardened.sandbox.soak.traffic import send

HANG_UP_S = (0.05, 0.5)
TIMEOUT_S = 120.0
METRICS = (("req_s", "req/s, stayed"), ("p99_s", "p99 s, stayed"))  # the first higher-is-better


def catalogue(count: Counter, requests: int, tokens: int, seed: int) -> Catalogue:
    """One prompt of ``tokens`` tokens by ``count`` (prefill's tokenizer) per request, drawn
    with ``seed``; answers of 16-64 tokens."""
    texts = sized(count, WordCosts.measure(count), [Draft(tokens, f"{seed}/storm/{i}") for i in range(requests)])
    rng = random.Random(f"{seed}/storm")
    return Catalogue([Prompt(t.text, t.tokens, rng.randint(16, 64)) for t in texts], [], [], {})


def storm(lb_url: str, cat: Catalogue, concurrency: int, share: float, seed: int) -> dict:
    """One storm of ``len(cat.fitting)`` requests: the stayed requests' throughput and p99, and
    the statuses other than 200 they got."""
    requests = len(cat.fitting)
    rng = random.Random(f"{seed}/{share}")
    hang_ups = [rng.uniform(*HANG_UP_S) if rng.random() < share else None for _ in range(requests)]

    def one(i: int):
        step = Step(client=i % concurrency, index=i, kind="fits", prompt=i, fault=None, fault_after_s=0.0,
                    stop_s=0.0, variant=0)
        return send(lb_url, step, cat, f"storm-{seed}-{share}-{i}", TIMEOUT_S, hang_ups[i])

    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        sent = list(pool.map(one, range(requests)))
    wall = time.monotonic() - began
    # Stayed by the schedule, the same requests on every arm: a request due to hang up that was
    # answered first would otherwise count only on the faster build.
    stayed = [s for s, hang_up in zip(sent, hang_ups) if hang_up is None]
    done = [s.seconds for s in stayed if s.status == 200]
    return {"share": share, "req_s": len(done) / wall, "p99_s": quantile(done, 0.99) if done else float("inf"),
            "hung_up": sum(s.hung_up for s in sent), "not_200": sorted({str(s.status) for s in stayed if s.status != 200})}


def storms(cluster: Cluster, shares: list[int], requests: int, concurrency: int, tokens: int, seed: int) -> list[dict]:
    """Every share's storm on one cluster, then the check that it still serves."""
    cat = catalogue(counter(cluster.prefill_url, TIMEOUT_S), requests, tokens, seed)
    found = [storm(cluster.lb_url, cat, concurrency, share / 100, seed) for share in shares]
    after = cluster.generate(cat.fitting[0].text, 4, timeout=60)
    if after.status != 200:
        raise SystemExit(f"the cluster did not serve after the abort storms (HTTP {after.status}): {after.body[:300]}")
    return found
