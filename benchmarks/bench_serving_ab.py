"""Hardened against upstream the way SGLang's users measure serving: SGLang's own load
generator through the load balancer, the arms interleaved in one run, ratios with confidence
intervals.

    python benchmarks/bench_serving_ab.py --base 0.5.23 --pairs 10 --concurrency 1,4,16 \\
        --json ab-0.5.23.json --plot docs/performance-0.5.23.png
    python benchmarks/bench_serving_ab.py --report ab-0.5.23.json     # its table again
    python benchmarks/bench_serving_ab.py --base 0.5.23 --pairs 3 --concurrency '' --prompts '' \
        --abort-shares 0,10,20,30 --storm-plot h5.png                    # abort storms only

Each pair starts one cluster per arm, in an order drawn anew per pair (seeded), warms it up, and runs `python -m sglang.benchmark.serving` (the base's own, every base
has it) through mini-lb at each concurrency, with the pair's seed: every arm of a pair gets the
same prompts. Arms: upstream; upstream again (the A/A arm: what this machine cannot resolve);
hardened; hardened with H8 switched off (SGLANG_HARDENED_PAGE_TAGS=off: H8's own share).
Reported per concurrency and metric: the median over pairs of arm/upstream, with a
distribution-free 95 % interval over pairs (order statistics; the range, at 93.75 %, with five
pairs: use ten or more), and each role's peak RSS (VmHWM summed over its processes).
Lower is better for the latencies, higher for the throughputs. Output: a table on stdout,
``--json`` (every run and every ratio), ``--plot`` (a PNG of the ratios and their intervals).

With ``--abort-shares``, each cluster then runs an abort storm per share
(`abort_storm.py`: clients hanging up mid-request, H5's holds out of the pool), on the same
clusters, reported the same way: requests/s and p99 of the requests that stayed.

The dataset is the generator's `random-ids` (no download): input lengths up to
``--input-len`` and outputs up to ``--output-len`` tokens, both drawn down to
``--range-ratio`` of that (by default 63-900 and 17-256). Pools hold the context on both
roles (H7-safe).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from abort_storm import METRICS as STORM_METRICS  # benchmarks/ is on sys.path when run as a script
from abort_storm import storms
from cli_args import ints, serving_options
from stats import median_interval

from sglang_hardened.common.knobs import PAGE_TAGS
from sglang_hardened.common.table import format_table
from sglang_hardened.sandbox.cluster import Cluster, ClusterParams, start
from sglang_hardened.sandbox.env import SandboxEnv, build_env, default_overlay, wheels_for, with_load_generator
from sglang_hardened.sandbox.model import ensure_model
from sglang_hardened.sandbox.soak.faults import group_pids
from sglang_hardened.sandbox.soak.run import rss_mib

PARAMS = dict(prefill_pool_tokens=4096, decode_pool_tokens=8192, context_length=2048)
# (key in the generator's result, label); the first two are throughputs (higher is better)
METRICS = (("request_throughput", "req/s"), ("output_throughput", "output tok/s"),
           ("mean_ttft_ms", "TTFT mean"), ("p99_ttft_ms", "TTFT p99"), ("mean_itl_ms", "ITL mean"),
           ("p99_itl_ms", "ITL p99"), ("p99_e2e_latency_ms", "e2e p99"))
BASELINE = "upstream"
STORM_LEVEL = "aborted %"  # an abort storm's setting: the share of requests whose client hangs up


@dataclass(frozen=True)
class Arm:
    """One build a run measures: hardened or not, and the servers' extra environment."""

    hardened: bool
    env: tuple[str, ...] = ()


ARMS = {"upstream": Arm(False), "upstream-again": Arm(False), "hardened": Arm(True),
        "hardened-h8-off": Arm(True, (f"{PAGE_TAGS.name}=off",))}


def schedule(arms: list[str], pairs: int, seed: int) -> list[tuple[int, str]]:
    """(pair, arm) in the order they run: each pair runs every arm once, in an order drawn anew
    per pair (seeded), so neither drift over the run nor the arm run just before falls on one
    arm more than on another."""
    rng = random.Random(seed)
    return [(p, arm) for p in range(pairs) for arm in rng.sample(arms, len(arms))]


def ratios(runs: list[dict], arms: list[str], level: str = "concurrency", metrics=METRICS) -> list[dict]:
    """Per arm but the baseline, setting (its ``level``: concurrency, or an abort storm's share)
    and metric: arm/baseline over the pairs that ran both, as median and interval."""
    by = {(r["pair"], r["arm"], r[level]): r["result"] for r in runs}
    out = []
    for arm in (a for a in arms if a != BASELINE):
        for c in sorted({r[level] for r in runs}):
            pairs = sorted(p for p, a, cc in by if a == arm and cc == c and (p, BASELINE, c) in by)
            for key, label in metrics:
                values = [by[p, arm, c][key] / by[p, BASELINE, c][key] for p in pairs
                          if by[p, BASELINE, c].get(key)]
                if values:
                    med, lo, hi, coverage = median_interval(values)
                    out.append({"arm": arm, level: c, "metric": key, "label": label, "pairs": len(values),
                                "median": med, "low": lo, "high": hi, "coverage": coverage})
    return out


def pin(cluster: Cluster, cores: set[int]) -> None:
    """Move every thread of both servers onto ``cores``."""
    for role in ("prefill", "decode"):
        for pid in group_pids(cluster.procs[role].pid):
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue  # a process that ended while read
            for task in tasks:
                try:
                    os.sched_setaffinity(int(task.name), cores)
                except OSError:
                    continue  # a thread that ended


def load(env, cluster: Cluster, model: Path, args, concurrency: int, prompts: int, seed: int,
         cores: set[int] | None) -> dict:
    """One run of the base's own load generator; its result (the JSON line it writes)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.jsonl"
        cmd = [str(env.python), "-m", "sglang.benchmark.serving", "--backend", "sglang",
               "--base-url", cluster.lb_url, "--tokenizer", str(model), "--model", str(model),
               "--dataset-name", "random-ids", "--num-prompts", str(prompts),
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-range-ratio", str(args.range_ratio), "--max-concurrency", str(concurrency),
               "--request-rate", "inf", "--seed", str(seed), "--output-file", str(out), "--disable-tqdm"]
        try:
            done = subprocess.run(cmd, env=env.environ(), capture_output=True, text=True, timeout=3600,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the load generator ran over an hour at concurrency {concurrency}") from None
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"the load generator failed ({done.returncode}): {done.stderr[-2000:]}")
        result = json.loads(out.read_text().splitlines()[-1])
    if result.get("completed") != prompts:
        raise SystemExit(f"{result.get('completed')} of {prompts} requests completed: the run is not comparable")
    return result


@functools.cache
def environment(base: str, hardened: bool) -> tuple[SandboxEnv, Path]:
    """The build's environment with the load generator, and its model: resolved once a run (a
    wheel is hashed to find its cached environment), not once a cluster."""
    env = with_load_generator(build_env(base, wheels_for(base, hardened), default_overlay()))
    return env, ensure_model(env)


def one_cluster(base: str, arm: str, args, settings: list[tuple[int, int]], pair: int,
                cores: tuple[set[int], set[int]] | None) -> tuple[list[dict], list[dict]]:
    """Start the arm's cluster, warm it up, run every setting, then every abort storm, stop it;
    the load generator's runs and the storms'."""
    spec = ARMS[arm]
    env, model = environment(base, spec.hardened)
    cluster = start(env, ClusterParams(base=base, extra_env=spec.env, **PARAMS), model)
    try:
        if cores:
            pin(cluster, cores[0])
        if args.warmup and settings:
            load(env, cluster, model, args, max(c for c, _ in settings), args.warmup, args.seed - 1, cores and cores[1])
        runs = []
        for concurrency, prompts in settings:
            result = load(env, cluster, model, args, concurrency, prompts, args.seed + pair, cores and cores[1])
            runs.append({"pair": pair, "arm": arm, "concurrency": concurrency, "prompts": prompts,
                         "result": {k: result[k] for k, _ in METRICS} | {"duration": result["duration"]}})
        rss = {role: rss_mib(cluster.procs[role].pid, "VmHWM") for role in ("prefill", "decode")}
        found = storms(cluster, args.abort_shares, args.storm_requests, args.storm_concurrency, args.storm_tokens,
                       args.seed + pair) if args.abort_shares else []
        return ([r | {"peak_rss_mib": rss} for r in runs],
                [{"pair": pair, "arm": arm, STORM_LEVEL: round(f.pop("share") * 100), "result": f} for f in found])
    finally:
        cluster.stop()


def resolution(found: list[dict], level: str = "concurrency") -> dict[tuple[int, str], float]:
    """Per (setting, metric): the smallest effect the A/A arm says this rig can tell from
    noise, as a fraction (the farther end of its interval from 1)."""
    return {(r[level], r["metric"]): max(r["high"] - 1, 1 - r["low"])
            for r in found if r["arm"] == "upstream-again"}


def table(found: list[dict], runs: list[dict], arms: list[str], level: str = "concurrency", metrics=METRICS) -> str:
    shown = [a for a in arms if a != BASELINE]
    cell = {(r["arm"], r[level], r["metric"]): f"{r['median']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
            for r in found}
    floor = resolution(found, level)
    rows = [(str(c), label, *(cell.get((a, c, key), "-") for a in shown),
             f"±{100 * floor[c, key]:.1f} %" if (c, key) in floor else "-")
            for c in sorted({r[level] for r in runs}) for key, label in metrics]
    rss = {a: [r["peak_rss_mib"] for r in runs if r["arm"] == a and "peak_rss_mib" in r] for a in arms}
    for role in ("prefill", "decode") if rss[BASELINE] else ():
        rows.append(("-", f"peak RSS {role} MiB", *(
            f"{statistics.median(x[role] for x in rss[a]):.0f} (upstream {statistics.median(x[role] for x in rss[BASELINE]):.0f})"
            if rss[a] else "-" for a in shown), "-"))
    return format_table((level, "metric", *(f"{a}/{BASELINE}" for a in shown), "A/A resolves"), rows)


def plot(found: list[dict], path: Path, title: str, level: str = "concurrency", metrics=METRICS) -> None:
    """The ratios and their intervals, one panel per metric, the setting on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in found}, key=list(ARMS).index)
    levels = sorted({r[level] for r in found})
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (key, label) in zip(axes, metrics):
        for i, arm in enumerate(arms):
            pts = [r for r in found if r["arm"] == arm and r["metric"] == key]
            xs = [levels.index(r[level]) + (i - (len(arms) - 1) / 2) * 0.15 for r in pts]
            ax.errorbar(xs, [r["median"] for r in pts], capsize=3, fmt="o", label=arm,
                        yerr=[[r["median"] - r["low"] for r in pts], [r["high"] - r["median"] for r in pts]])
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_title(label)
        ax.set_xlabel(level)
    axes[0].set_ylabel(f"arm / {BASELINE} (median, interval)")
    axes[-1].legend(fontsize=7)
    fig.suptitle("\n".join(textwrap.wrap(title, 45 * len(metrics))), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/bench_serving_ab.py --base 0.5.23 --pairs 10 "
                                            "--concurrency 1,4,16 --json ab.json --plot ab.png",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--pairs", type=int, default=10, help="runs of every arm (default 10)")
    parser.add_argument("--concurrency", default="1,4,16", help="--max-concurrency settings")
    parser.add_argument("--prompts", default="16,32,64", help="prompts per run, one per concurrency setting")
    serving_options(parser)
    parser.add_argument("--pin", default="", help="SERVER_CORES:GENERATOR_CORES, e.g. 0-13:14-15: both servers' "
                        "threads and the load generator (the balancer is not pinned; default: nothing pinned)")
    parser.add_argument("--abort-shares", type=ints, default=[], metavar="PERCENT,...",
                        help="after the load generator, an abort storm per share on each cluster (H5's cost; "
                             "benchmarks/abort_storm.py), e.g. 0,10,20,30")
    parser.add_argument("--storm-requests", type=int, default=48, help="requests per abort storm")
    parser.add_argument("--storm-concurrency", type=int, default=8)
    parser.add_argument("--storm-tokens", type=int, default=600, help="prompt tokens of a storm's requests")
    parser.add_argument("--json", type=Path, help="write every run and ratio here")
    parser.add_argument("--plot", type=Path, help="write a PNG of the ratios here")
    parser.add_argument("--storm-plot", type=Path, help="write a PNG of the abort storms' ratios here")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="print the table (and --plot) of a run's --json again, without running")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        print(f"{saved['base']}, {saved['date']}, {saved['cores']} cores: {saved['command']}")
        report(saved["runs"], saved.get("storms", []), saved["arms"], args, f"{saved['base']}: {saved['command']}")
        return
    arms = [a.strip() for a in args.arms.split(",")]
    if unknown := [a for a in arms if a not in ARMS] + ([] if BASELINE in arms else [f"(no {BASELINE})"]):
        parser.error(f"--arms: {', '.join(unknown)}; choose from {', '.join(ARMS)} including {BASELINE}")
    levels, prompts = ints(args.concurrency), ints(args.prompts)
    if (len(levels) != len(prompts) or args.pairs < 1 or min(levels + prompts, default=1) < 1 or args.warmup < 0
            or not (levels or args.abort_shares)):
        parser.error("--prompts needs one positive count per --concurrency setting (none: abort storms only), "
                     "--pairs at least 1, --warmup at least 0")
    if any(not 0 <= x <= 100 for x in args.abort_shares) or min(args.storm_requests, args.storm_concurrency) < 1:
        parser.error("--abort-shares are percentages 0-100; --storm-requests and --storm-concurrency at least 1")
    try:
        cores = _cores(args.pin) if args.pin else None
    except ValueError:
        parser.error(f"--pin {args.pin!r}: give SERVER_CORES:GENERATOR_CORES, e.g. 0-13:14-15")

    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    runs: list[dict] = []
    storm_runs: list[dict] = []
    order = schedule(arms, args.pairs, args.seed)
    began = time.monotonic()
    for i, (pair, arm) in enumerate(order, 1):
        print(f"[{i}/{len(order)}] pair {pair + 1} {arm} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        served, stormed = one_cluster(args.base, arm, args, list(zip(levels, prompts)), pair, cores)
        runs, storm_runs = runs + served, storm_runs + stormed
        if args.json:  # after every cluster: a run that fails later keeps what it measured
            args.json.write_text(json.dumps({
                "base": args.base, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
                "cores": os.cpu_count(), "arms": arms, "done": i == len(order), "runs": runs,
                "ratios": ratios(runs, arms), "storms": storm_runs,
                "storm_ratios": ratios(storm_runs, arms, STORM_LEVEL, STORM_METRICS)}, indent=1))
    print(f"{args.base}, {args.pairs} pairs, {os.cpu_count()} cores")
    report(runs, storm_runs, arms, args, f"{args.base}: {command}")


def report(runs: list[dict], storm_runs: list[dict], arms: list[str], args, title: str) -> None:
    """The tables (the load generator's, the abort storms') and the plots asked for."""
    for these, level, metrics, path in ((runs, "concurrency", METRICS, args.plot),
                                        (storm_runs, STORM_LEVEL, STORM_METRICS, args.storm_plot)):
        if not these:
            continue
        found = ratios(these, arms, level, metrics)  # recomputed on --report: the intervals as this version makes them
        print(f"median of arm/{BASELINE} over pairs [interval: {100 * min(r['coverage'] for r in found):.2f} % or more]")
        print(table(found, these, arms, level, metrics))
        if path:
            plot(found, path, title, level, metrics)
    wrong = {(r["arm"], status) for r in storm_runs for status in r["result"]["not_200"]}
    if storm_runs:
        print("abort storms, requests that stayed and got no 200: "
              + (", ".join(f"{arm} {status}" for arm, status in sorted(wrong)) or "none"))


def _cores(pin: str) -> tuple[set[int], set[int]]:
    """``--pin``'s two core sets; ValueError when it is not SERVER:GENERATOR core lists."""
    sides = pin.split(":")
    if len(sides) != 2:
        raise ValueError(pin)
    servers, generator = ({c for part in side.split(",") for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
                          for side in sides)
    if not servers or not generator:
        raise ValueError(pin)
    return servers, generator


if __name__ == "__main__":
    main()
