"""`sglang-hardened lb` against sglang-router's mini-lb, in front of the same CPU PD cluster.

    python benchmarks/bench_lb.py --base 0.5.23 --requests 200 --concurrency 8

One cluster (upstream servers, H7-safe pools) with both load balancers in
front of it. Latency: --requests sequential one-token requests per LB, the
LBs alternating request by request, and the same pair of calls made straight
to prefill and decode (what every LB does; the floor); each LB's added
latency is its percentile minus the floor's. Throughput: --requests requests
from --concurrency clients through each LB in turn, alternating --repeat
times. Goal: ours is not slower than mini-lb.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_hardened.common.table import format_table
from sglang_hardened.operations.oracle import generate
from sglang_hardened.sandbox.cluster import ClusterParams, start
from sglang_hardened.sandbox.env import build_env, default_overlay, wheels_for
from sglang_hardened.sandbox.model import ensure_model

PROMPT = "the key to the page cache is " * 4
WARMUP = 5
SAFE = dict(prefill_pool_tokens=2048, decode_pool_tokens=4096, context_length=1024)


def _timed(send) -> float:
    start = time.perf_counter()
    reply = send()
    if reply.status != 200:
        raise SystemExit(f"request failed: {reply.status} {reply.body[:200]}")
    return time.perf_counter() - start


def _direct(prefill: str, decode: str, bootstrap_port: int, pool: ThreadPoolExecutor):
    """The floor: the two calls an LB makes, made by the client itself."""
    def send():
        extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                 "bootstrap_room": random.getrandbits(63)}
        calls = [pool.submit(generate, url, PROMPT, 1, 120, extra) for url in (prefill, decode)]
        return [c.result() for c in calls][1]
    return send


def _percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.5.23")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = build_env(args.base, wheels_for(args.base, False), default_overlay())
    cluster = start(env, ClusterParams(base=args.base, **SAFE), ensure_model(env))
    try:
        lbs = {"mini-lb": cluster.lb_url, "sglang-hardened lb": cluster.add_lb("hardened", env)}
        with ThreadPoolExecutor(max(2, args.concurrency)) as pool:
            senders = {name: (lambda url=url: generate(url, PROMPT, 1, 120)) for name, url in lbs.items()}
            senders["direct (floor)"] = _direct(cluster.prefill_url, cluster.decode_url, cluster.bootstrap_port, pool)
            for send in senders.values():  # warm-up: connections, first-request paths
                for _ in range(WARMUP):
                    _timed(send)
            latency: dict[str, list[float]] = {name: [] for name in senders}
            for _ in range(args.requests):
                for name, send in senders.items():
                    latency[name].append(_timed(send))
            rates: dict[str, list[float]] = {name: [] for name in lbs}
            for _ in range(args.repeat):
                for name, url in lbs.items():
                    begin = time.perf_counter()
                    list(pool.map(lambda _: _timed(lambda: generate(url, PROMPT, 1, 120)), range(args.requests)))
                    rates[name].append(args.requests / (time.perf_counter() - begin))
    finally:
        cluster.stop()
    floor = {q: _percentile(latency["direct (floor)"], q) for q in (50, 99)}
    rows = [(name, f"{_percentile(xs, 50) * 1e3:.1f}", f"{_percentile(xs, 99) * 1e3:.1f}",
             f"{(_percentile(xs, 50) - floor[50]) * 1e3:+.1f}", f"{(_percentile(xs, 99) - floor[99]) * 1e3:+.1f}",
             f"{statistics.median(rates[name]):.1f}" if name in rates else "-") for name, xs in latency.items()]
    ratio = statistics.median(rates["sglang-hardened lb"]) / statistics.median(rates["mini-lb"])
    rows.append(("ours / mini-lb", "", "", "", "", f"{ratio:.2f}"))
    print(format_table(("path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms",
                        f"requests/s (x{args.concurrency}, median)"), rows))


if __name__ == "__main__":
    main()
