"""The CPU PD rig, upstream vs hardened on one base: cluster start-up and requests/s.

    python benchmarks/bench_cluster.py --base 0.5.23 --repeat 3 --requests 40

Upstream and hardened clusters are started alternately (same machine, same
run); each takes --requests fitting greedy requests through mini-lb, one at
a time. Reported: median start-up seconds and median requests/s per build,
and the hardened/upstream ratios. This is the rig the hardening overhead is
measured on; the tiny model makes it a measure of serving overhead, not of
compute. Uses H7-safe parameters (pools hold the context on both roles).
"""

from __future__ import annotations

import argparse
import statistics
import time

from sglang_hardened.common.table import format_table
from sglang_hardened.sandbox.cluster import ClusterParams, start
from sglang_hardened.sandbox.env import build_env, default_overlay, wheels_for
from sglang_hardened.sandbox.model import ensure_model

PROMPT = "the key to the page cache is " * 4
SAFE = dict(prefill_pool_tokens=2048, decode_pool_tokens=4096, context_length=1024)


def one_run(base: str, hardened: bool, requests: int) -> tuple[float, float]:
    """(start-up seconds, requests/s) of one fresh cluster."""
    env = build_env(base, wheels_for(base, hardened), default_overlay())
    cluster = start(env, ClusterParams(base=base, **SAFE), ensure_model(env))
    try:
        begin = time.perf_counter()
        for _ in range(requests):
            reply = cluster.generate(PROMPT)
            if reply.status != 200:
                raise SystemExit(f"request failed: {reply.status} {reply.body[:200]}")
        return cluster.startup_s, requests / (time.perf_counter() - begin)
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.5.23")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeat):
        for hardened in (False, True):
            runs[hardened].append(one_run(args.base, hardened, args.requests))
    med = {h: (statistics.median(s for s, _ in r), statistics.median(q for _, q in r)) for h, r in runs.items()}
    print(format_table(("build", "start-up s (median)", "requests/s (median)", "runs (start s / req/s)"), [
        (f"{args.base} {'hardened' if h else 'upstream'}", f"{med[h][0]:.1f}", f"{med[h][1]:.2f}",
         "  ".join(f"{s:.0f}/{q:.2f}" for s, q in runs[h])) for h in (False, True)
    ] + [("hardened/upstream", f"{med[True][0] / med[False][0]:.2f}", f"{med[True][1] / med[False][1]:.3f}", "")]))


if __name__ == "__main__":
    main()
