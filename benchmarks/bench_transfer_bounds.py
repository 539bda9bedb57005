"""H6's bounded Mooncake calls against one unbounded call, on real Mooncake TCP over 127.0.0.1.

    python benchmarks/bench_transfer_bounds.py --repeat 5
    python benchmarks/bench_transfer_bounds.py --growth 1024,4096,16384,65536 --plot h6.png   # by entries

Throughput: the same write (--entries entries of --entry-kib KiB, under
Mooncake TCP's ~2,050-entry per-call limit so that one unbounded call works)
sent as one call and through transfer_bounds with the policy's bounds,
alternately, each on a fresh engine pair; goal: bounded/unbounded seconds
<= 1.05 (throughput >= 95 %). Calls at once: --threads writes of
--thread-entries entries to one peer together (as the per-layer path
writes every layer), unbounded (each its own call; together still under
the per-peer limit, so it works) against the seam, which lets no more than
max_entries_per_call entries be in flight to the peer. Per-call times: a write too large for one call
(--big-entries) split by the policy's bounds, and the same with the byte
bound made to bite (--byte-bound-mib, as a slow configured link would); each
call's seconds against the release timeout the bound is derived from.

With --growth: one write's time as the prompt grows (a deep model's transfer:
one entry per page per layer, --growth-entry-kib each), bounded against one
unbounded call at each size, alternately; above Mooncake TCP's per-call limit
the unbounded call fails, and the table says so.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cli_args import ints
from floor_report import print_against_floor  # benchmarks/ is on sys.path when run as a script
from growth_plot import plot_growth
from stats import quantile

from sglang_hardened.common.table import format_table
from sglang_hardened.runtime.policy import load_limits
from sglang_hardened.runtime.release_timeout import release_timeout_s
from sglang_hardened.runtime.transfer_bounds import bounds_from
from sglang_hardened.sandbox.env import build_env, default_overlay, upstream_wheel
from sglang_hardened.sandbox.mooncake_pair import Case, run

BIG_ENTRY_BYTES = 16 << 10  # the many-call write's entries: a page of a small model's layer


def growth(env, sizes: list[int], entry_bytes: int, repeat: int, plot: Path | None) -> None:
    """H6's growth table: the median seconds of one write of each size, bounded and as one call."""
    policy = bounds_from({})
    bounded = (policy.max_entries, policy.max_bytes)
    cases = [Case(n, entry_bytes, bounds) for _ in range(repeat) for n in sizes for bounds in (None, bounded)]
    outcomes, _ = run(env, cases, timeout_s=3600)
    rows, series = [], {"bounded (H6)": [], "one unbounded call": []}
    for n in sizes:
        got = {b: [o for c, o in zip(cases, outcomes) if (c.entries, c.bounds) == (n, b)] for b in (None, bounded)}
        if not all(o.arrived for o in got[bounded]):
            raise SystemExit(f"a bounded write of {n} entries did not arrive: {got[bounded]}")
        b_s = statistics.median(o.seconds for o in got[bounded])
        series["bounded (H6)"].append((n, b_s))
        calls = statistics.median(len(o.call_seconds) for o in got[bounded])
        if all(o.arrived for o in got[None]):
            u_s = statistics.median(o.seconds for o in got[None])
            series["one unbounded call"].append((n, u_s))
            unbounded, ratio = f"{u_s:.3f}", f"{b_s / u_s:.2f}"
        else:
            unbounded, ratio = f"fails (rc {next(o.rc for o in got[None] if not o.arrived)})", "-"
        mib = n * entry_bytes / (1 << 20)
        rows.append((str(n), f"{mib:.0f}", f"{calls:.0f}", f"{b_s:.3f}", f"{b_s / n * 1e6:.1f}", unbounded, ratio))
    print(f"one write of N entries of {entry_bytes >> 10} KiB, Mooncake TCP on 127.0.0.1, medians of {repeat}; "
          f"bounds: {policy.max_entries} entries, {policy.max_bytes >> 20} MiB per call")
    print(format_table(("entries", "MiB", "bounded calls", "bounded s", "us/entry", "unbounded s", "bounded/unbounded"),
                       rows))
    if plot:
        plot_growth(plot, "H6: one transfer by its size", "entries (pages x layers)", "seconds", series)
        print(f"plot: {plot}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="example: python benchmarks/"
                                     "bench_transfer_bounds.py --growth 1024,4096,16384,65536 --plot h6.png")
    parser.add_argument("--base", default="0.5.23", help="sandbox environment whose Mooncake is used")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--entries", type=int, default=2000)
    parser.add_argument("--entry-kib", type=int, default=64)
    parser.add_argument("--big-entries", type=int, default=16384)
    parser.add_argument("--byte-bound-mib", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--thread-entries", type=int, default=500)
    parser.add_argument("--growth", type=ints, metavar="ENTRIES,...", help="only the growth table, at these write sizes")
    parser.add_argument("--growth-entry-kib", type=int, default=4)
    parser.add_argument("--plot", type=Path, help="with --growth: a PNG of seconds against entries")
    args = parser.parse_args(argv)
    env = build_env(args.base, [upstream_wheel(args.base)], default_overlay())
    policy = bounds_from({})
    if args.growth:
        growth(env, args.growth, args.growth_entry_kib << 10, args.repeat, args.plot)
        return
    bounded = (policy.max_entries, policy.max_bytes)
    entry_bytes = args.entry_kib << 10
    cases = [Case(args.entries, entry_bytes, bounds) for _ in range(args.repeat) for bounds in (None, bounded)]
    cases += [Case(args.big_entries, BIG_ENTRY_BYTES, bounds) for _ in range(args.repeat)
              for bounds in (bounded, (policy.max_entries, args.byte_bound_mib << 20))]
    together = args.threads * args.thread_entries
    cases += [Case(together, entry_bytes, bounds, args.threads) for _ in range(args.repeat) for bounds in (None, bounded)]
    outcomes, log = run(env, cases, timeout_s=3600)
    failed = [(c, o.rc) for c, o in zip(cases, outcomes) if not o.arrived]
    if failed:
        raise SystemExit(f"writes that did not arrive: {failed}\n{log[-2000:]}")
    for entries, threads, unbounded_label in ((args.entries, 1, "unbounded (1 call)"),
                                              (together, args.threads, f"unbounded ({args.threads} calls at once)")):
        seconds = {b: [o.seconds for c, o in zip(cases, outcomes)
                       if (c.entries, c.threads, c.bounds) == (entries, threads, b)] for b in (None, bounded)}
        mib = entries * entry_bytes / (1 << 20)
        print(f"{entries} entries x {args.entry_kib} KiB = {mib:.0f} MiB per write, in {threads} part(s) at once, "
              f"Mooncake TCP on 127.0.0.1")
        print_against_floor(unbounded_label, seconds[None], f"bounded ({policy.max_entries} entries in flight)",
                            seconds[bounded], "bounded/unbounded",
                            f"goal <= 1.05; throughput {mib / statistics.median(seconds[bounded]):.0f} vs "
                            f"{mib / statistics.median(seconds[None]):.0f} MiB/s", digits=3)
        print()
    limits = load_limits("H6")
    timeout_s = release_timeout_s({})
    rows = []
    for bounds in (bounded, (policy.max_entries, args.byte_bound_mib << 20)):
        calls = [s for c, o in zip(cases, outcomes) if c.entries == args.big_entries and c.bounds == bounds
                 for s in o.call_seconds]
        mib_per_call = min(bounds[1], bounds[0] * BIG_ENTRY_BYTES) / (1 << 20)
        write = f"{args.big_entries} x {BIG_ENTRY_BYTES >> 10} KiB, <= {bounds[0]} entries, <= {mib_per_call:.0f} MiB"
        rows.append((write, len(calls),
                     f"{quantile(calls, 0.5):.3f}", f"{quantile(calls, 0.99):.3f}", f"{max(calls):.3f}",
                     f"{max(calls) / timeout_s:.4f}"))
    print(f"per-call seconds against the release timeout ({timeout_s} s; the byte bound allows "
          f"{policy.max_bytes / limits['link_rate_bytes_per_s']:.0f} s at the configured link rate)")
    print(format_table(("write", "calls", "p50 s", "p99 s", "max s", "max / timeout"), rows))


if __name__ == "__main__":
    main()
