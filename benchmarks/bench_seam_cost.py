"""What the hardening seams cost the scheduler, and the servers' CPU per request, hardened
against upstream: the two measures this machine resolves where the end-to-end A/B does not.

    python benchmarks/bench_seam_cost.py --base 0.5.23 --runs 8 --prompts 32 --concurrency 4 \\
        --json seam-cost.json
    python benchmarks/bench_seam_cost.py --report seam-cost.json      # its tables again

Each run starts one cluster per arm, in an order drawn per run (seeded), warms it up and runs
the A/B's workload (benchmarks/bench_serving_ab.py: SGLang's own load generator, `random-ids`
inputs 63-900 and outputs 17-256 tokens, the run's seed, so every arm of a run serves the same
prompts), with ``--enable-metrics`` on every arm. Arms: upstream; hardened; and hardened with
the seam switch on (``SGLANG_HARDENED_SEAM_COST_DIR``, runtime/seam_cost.py: every seam the
series' patches call, as pipeline/seams.py reads them, and every metric write, timed on its
thread). Around the workload it reads:

- **per seam** (seams arm): its calls and thread CPU time per completed request, and that as a
  share of the same role's scheduler loop (the scheduler process's main thread) CPU per
  request, both read by the server at one instant; the timer's own cost (measured at each
  process's start: what it records for a call that does nothing, and what it adds to the
  thread) subtracted, calls times cost, from the seams and from the scheduler, and shown;
- **per role** (every arm): the CPU time of the server's process group (utime + stime from
  /proc of each process, every thread) per completed request.

Intervals: seams, the mean over runs with a 95 % t interval; the process groups' CPU, the
median over runs of hardened/upstream (and seams/hardened: the switch's own cost end to end)
with the A/B's distribution-free interval (order statistics; the range with five runs, at
93.75 %). On the CPU sandbox the scheduler's main thread also runs the tiny model's forward
pass, which a GPU runs instead: its share here is a lower bound of the share on a GPU node; the
seams' microseconds are what to set against a GPU step (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from bench_serving_ab import PARAMS, environment, load  # benchmarks/ is on sys.path
from cli_args import serving_options
from stats import mean_interval, median_interval

from sglang_hardened.common.knobs import SEAM_COST_DIR
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.common.table import format_table
from sglang_hardened.pipeline.seams import runtime_seams
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.runtime.seam_cost import SEAMS_FILE
from sglang_hardened.sandbox.cluster import Cluster, ClusterParams, start
from sglang_hardened.sandbox.env import overlay_module
from sglang_hardened.sandbox.soak.faults import group_pids

UPSTREAM_OWNERS = ("upstream", "upstream forward", "harness")  # the syncs counter's owners that are no seam
SITE_DIFFERS = 0.5  # syncs per request between builds that make an upstream site worth listing
CPU_ARMS = ("upstream", "hardened", "seams")  # seams: hardened with every seam timed
# the syncs arms, each counting on one build: upstream's, hardened's, and hardened's started as operators
# start it (`sglang-hardened launch`: H10's policy flags on, among them 0.5.23's KV checksum, which
# verifies each request on decode where H8 checks it)
SYNC_ARMS = {"upstream-syncs": "upstream", "hardened-syncs": "hardened", "launched-syncs": "launched"}
ARMS = (*CPU_ARMS, *SYNC_ARMS)
ROLES = ("prefill", "decode")
SCHEDULER = "sglang::scheduler"  # SGLang's title for a scheduler process (setproctitle)
TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")
GENERATOR_WARMUP = 1  # requests the load generator sends before its timed ones (--warmup-requests: 1 in every base)
FRESH_S = 15.0  # how long to wait for every server process to write its seam totals again
SYNCS_ENV = overlay_module("sgl_syncs").DIR_ENV


def seam_list(base: str) -> dict[str, list[str]]:
    """The seams the base's series calls, with their hardening ids: what the switch times."""
    series = load_series(patches_dir(), base)
    return {seam: sorted(ids) for seam, ids in runtime_seams((p.hardening_id, p.diff) for p in series.patches).items()}


def group_cpu_ns(cluster: Cluster) -> dict[str, int]:
    """Per role, the CPU time (user + system, every thread) of its server's processes so far."""
    found = {}
    for role in ROLES:
        total = 0
        for pid in group_pids(cluster.procs[role].pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended since it was listed
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        found[role] = round(total * TICK_NS)
    return found


def fresh_totals(folder: Path, cluster: Cluster, after: float) -> dict[str, list[dict]]:
    """Per role, every server process's totals file in ``folder`` (the seams' or the syncs'), as
    written after ``after`` (time.time()), once each role's scheduler has written one."""
    deadline = time.monotonic() + FRESH_S
    while True:
        found: dict[str, list[dict]] = {role: [] for role in ROLES}
        stale = []
        for role in ROLES:
            for pid in group_pids(cluster.procs[role].pid):
                try:
                    data = json.loads((folder / f"{pid}.json").read_text())
                except (OSError, ValueError):
                    continue  # a process that imports no seam (or not yet written)
                (found[role] if data["written_at"] > after else stale).append(data)
        if not stale and all(any(p["title"].startswith(SCHEDULER) for p in found[role]) for role in ROLES):
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"no fresh totals within {FRESH_S:.0f} s in {folder}")
        time.sleep(0.1)


def _where(process: dict, main_thread: bool) -> str:
    if process["title"].startswith(SCHEDULER):
        return "scheduler loop" if main_thread else "scheduler, other thread"
    return "other process"


def seam_deltas(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict:
    """Per role: each (seam, where)'s calls and CPU ns over the window less the timer's recorded
    cost, the scheduler loop's CPU ns less what the timer added to it, and the timer's own cost."""
    found = {}
    for role in ROLES:
        rows: dict[str, dict] = defaultdict(lambda: {"ids": [], "calls": 0, "cpu_ns": 0.0})
        scheduler_ns = timer_ns = 0.0
        earlier = {p["pid"]: p for p in before[role]}
        for process in after[role]:
            old = earlier.get(process["pid"], {"main_cpu_ns": process["main_cpu_ns"], "seams": []})
            old_seams = {(s["seam"], s["main_thread"]): s for s in old["seams"]}
            timer = process["timer"]
            scheduler = process["title"].startswith(SCHEDULER)
            if scheduler:
                scheduler_ns += process["main_cpu_ns"] - old["main_cpu_ns"]
            for s in process["seams"]:
                prior = old_seams.get((s["seam"], s["main_thread"]), {"calls": 0, "cpu_ns": 0})
                calls = s["calls"] - prior["calls"]
                row = rows[f"{s['seam']}|{_where(process, s['main_thread'])}"]
                row["ids"] = s["ids"]
                row["calls"] += calls
                row["cpu_ns"] += s["cpu_ns"] - prior["cpu_ns"] - calls * timer["recorded_ns"]
                if scheduler and s["main_thread"]:
                    timer_ns += calls * timer["added_ns"]
        found[role] = {"seams": dict(rows), "scheduler_ns": scheduler_ns - timer_ns, "timer_ns": timer_ns}
    return found


def sync_deltas(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict:
    """Per role: the syncs counted on its schedulers' loops over the window, as
    ``{"kind|owner|site": calls}``."""
    found = {}
    for role in ROLES:
        counts: dict[str, int] = defaultdict(int)
        for sign, processes in ((-1, before[role]), (1, after[role])):
            for process in processes:
                for c in process["counts"]:
                    counts[f"{c['kind']}|{c['owner']}|{c['site']}"] += sign * c["calls"]
        found[role] = {k: n for k, n in counts.items() if n}
    return found


def one_cluster(base: str, arm: str, args, run: int, seams: dict[str, list[str]]) -> dict:
    """Start the arm's cluster, warm it up, run the workload between two readings, stop it."""
    env, model = environment(base, SYNC_ARMS.get(arm, arm) != "upstream")
    with tempfile.TemporaryDirectory(prefix="seam-cost-") as tmp:
        folder = Path(tmp)
        extra_env: tuple[str, ...] = ()
        if arm == "seams":
            (folder / SEAMS_FILE).write_text(json.dumps(seams))
            extra_env = (f"{SEAM_COST_DIR.name}={folder}",)
        elif arm in SYNC_ARMS:
            extra_env = (f"{SYNCS_ENV}={folder}",)
        counted = arm == "seams" or arm in SYNC_ARMS
        cluster = start(env, ClusterParams(base=base, extra_env=extra_env, extra_flags=("--enable-metrics",),
                                           via_launch=arm == "launched-syncs", **PARAMS), model)
        try:
            if args.warmup:
                load(env, cluster, model, args, args.concurrency, args.warmup, args.seed - 1, None)
            began = time.time()
            totals_before = fresh_totals(folder, cluster, began) if counted else None
            cpu_before = group_cpu_ns(cluster)
            result = load(env, cluster, model, args, args.concurrency, args.prompts, args.seed + run, None)
            cpu_after = group_cpu_ns(cluster)
            totals_after = fresh_totals(folder, cluster, time.time()) if counted else None
        finally:
            cluster.stop()
    found = {"run": run, "arm": arm, "requests": result["completed"] + GENERATOR_WARMUP, "duration": result["duration"],
             "group_cpu_ns": {role: cpu_after[role] - cpu_before[role] for role in ROLES}}
    if totals_before is not None and totals_after is not None:
        if arm == "seams":
            found["seams"] = seam_deltas(totals_before, totals_after)
        else:
            found["syncs"] = sync_deltas(totals_before, totals_after)
    return found


def _interval(values: list[float], digits: int) -> str:
    mean, half = mean_interval(values)
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def _per_request(measured: list[dict], role: str, ns_per_run: list[float]) -> tuple[list[float], list[float]]:
    """Per run: CPU ns over the window as us per completed request, and as a % of the role's
    scheduler loop's CPU per request."""
    us = [ns / r["requests"] / 1e3 for ns, r in zip(ns_per_run, measured)]
    return us, [100 * u * 1e3 * r["requests"] / r["seams"][role]["scheduler_ns"] for u, r in zip(us, measured)]


def _seam_ns(run: dict, role: str, keep) -> float:
    """The run's CPU ns over the window of the role's seam rows whose "seam|where" key ``keep`` accepts."""
    return sum(s["cpu_ns"] for k, s in run["seams"][role]["seams"].items() if keep(k))


def seam_table(runs: list[dict]) -> str:
    """Per role and seam: calls, CPU us per request and share of that role's scheduler loop's
    CPU per request, mean ± 95 % t half-width over runs; then the totals and the timer's cost."""
    measured = [r for r in runs if "seams" in r]
    rows = []
    for role in ROLES:
        per_run = [r["seams"][role] for r in measured]
        keys = sorted({k for p in per_run for k in p["seams"]})
        sched = [p["scheduler_ns"] / r["requests"] for p, r in zip(per_run, measured)]

        def line(label: str, ids: str, where: str, ns_per_run: list[float], calls: str = "") -> list[str]:
            us, share = _per_request(measured, role, ns_per_run)
            return [role, label, ids, where, calls, _interval(us, 2), _interval(share, 3)]

        for key in keys:
            seam, where = key.split("|")
            ns = [p["seams"].get(key, {}).get("cpu_ns", 0.0) for p in per_run]
            calls = [p["seams"].get(key, {}).get("calls", 0) / r["requests"] for p, r in zip(per_run, measured)]
            if sum(calls):
                ids = next(p["seams"][key]["ids"] for p in per_run if key in p["seams"])
                rows.append(line(seam, ",".join(ids), where, ns, f"{sum(calls) / len(calls):.1f}"))
        loop = [sum(s["cpu_ns"] for k, s in p["seams"].items() if k.endswith("|scheduler loop")) for p in per_run]
        rows.append(line("all seams on the scheduler loop", "", "scheduler loop", loop))
        rows.append(line("all seams", "", "every thread", [sum(s["cpu_ns"] for s in p["seams"].values())
                                                            for p in per_run]))
        rows.append(line("timer's own cost (subtracted)", "", "scheduler loop", [p["timer_ns"] for p in per_run]))
        rows.append([role, "scheduler loop itself", "", "scheduler loop", "", _interval([s / 1e3 for s in sched], 1),
                     "100"])
    both = [sum(r["seams"][role]["seams"][k]["cpu_ns"] for role in ROLES for k in r["seams"][role]["seams"])
            / sum(r["seams"][role]["scheduler_ns"] for role in ROLES) * 100 for r in measured]
    rows.append(["both", "all seams / both scheduler loops", "", "every thread", "", "", _interval(both, 3)])
    return format_table(["role", "seam", "ids", "where", "calls/req", "CPU us/req", "% of scheduler CPU"], rows)


def syncs_per_request(runs: list[dict], build: str, role: str, keep) -> list[float]:
    """Per run of ``build``'s syncs arm: the syncs counted on the role's scheduler loop whose
    "kind|owner|site" key ``keep`` accepts, per completed request."""
    return [sum(n for k, n in r["syncs"][role].items() if keep(k)) / r["requests"]
            for r in runs if SYNC_ARMS.get(r["arm"]) == build and "syncs" in r]


def _syncs(runs: list[dict], build: str, role: str, keep) -> str:
    """Mean ± 95 % t half-width over the build's runs; one run's count alone (a count's repeats
    differ only by how requests batched); "-" without a run of that build."""
    found = syncs_per_request(runs, build, role, keep)
    return (f"{found[0]:.2f}" if len(found) == 1 else _interval(found, 2)) if found else "-"


def _place(key: str) -> str:
    """A "kind|owner|site" key with an upstream owner's site cut to its file."""
    kind, owner, site = key.split("|")
    return f"{kind}|{owner}|{site.rsplit(':', 1)[0] if owner in UPSTREAM_OWNERS else site}"


def sync_table(runs: list[dict]) -> str:
    """Per role, owner (a seam, upstream's code, its CPU forward, the harness) and kind: syncs per
    completed request on the scheduler loop, each build, mean ± 95 % t half-width over runs; then
    the sites of every seam's syncs, and the files of upstream's whose count differs between
    the builds by SITE_DIFFERS a request (the patches move upstream's lines, so its sites are
    compared by file): they say whether a GPU node keeps that tensor on the device."""
    rows, sites = [], []
    builds = list(SYNC_ARMS.values())
    for role in ROLES:
        keys = sorted({k for r in runs if "syncs" in r for k in r["syncs"][role]})
        for owner_kind in sorted({(k.split("|")[1], k.split("|")[0]) for k in keys}):
            def keep(k: str, ok=owner_kind) -> bool:
                return (k.split("|")[1], k.split("|")[0]) == ok
            rows.append([role, *owner_kind, *(_syncs(runs, b, role, keep) for b in builds)])
        rows.append([role, "all", "all", *(_syncs(runs, b, role, lambda k: True) for b in builds)])
        for place in sorted({_place(k) for k in keys}):
            def here(k: str, x=place) -> bool:
                return _place(k) == x
            means = [sum(f) / len(f) for b in builds if (f := syncs_per_request(runs, b, role, here))]
            if place.split("|")[1] not in UPSTREAM_OWNERS or max(means) - min(means) >= SITE_DIFFERS:
                sites.append([role, *place.split("|"), *(_syncs(runs, b, role, here) for b in builds)])
    return (format_table(["role", "owner", "kind", *(f"{b} syncs/req" for b in builds)], rows) + "\n"
            + format_table(["role", "kind", "owner", "site", *(f"{b} syncs/req" for b in builds)], sites))


def summary_table(runs: list[dict]) -> str:
    """The table docs/performance.md opens with: per role and seam (every thread it runs on), its
    CPU us per request and share of the scheduler loop's CPU, and the syncs per request on the
    scheduler loop, upstream (the seam is not there) and hardened; then upstream's own code's
    syncs on each build, and the totals."""
    measured = [r for r in runs if "seams" in r]
    rows = []

    def syncs(role: str, keep) -> list[str]:
        return [_syncs(runs, build, role, keep) for build in SYNC_ARMS.values()]

    for role in ROLES:
        seams = sorted({k.split("|")[0] for r in measured for k in r["seams"][role]["seams"]})
        for seam in seams:
            us, share = _per_request(measured, role, [_seam_ns(r, role, lambda k: k.split("|")[0] == seam)
                                                      for r in measured])
            ids = next(r["seams"][role]["seams"][k]["ids"] for r in measured for k in r["seams"][role]["seams"]
                       if k.split("|")[0] == seam)
            if sum(us) > 0:
                rows.append([role, seam, ",".join(ids), _interval(us, 1), _interval(share, 3), "-",
                             *syncs(role, lambda k: k.split("|")[1] == seam)[1:]])
        us, share = _per_request(measured, role, [_seam_ns(r, role, lambda k: True) for r in measured])
        rows.append([role, "all seams", "", _interval(us, 1), _interval(share, 3), "-",
                     *syncs(role, lambda k: k.split("|")[1] not in UPSTREAM_OWNERS)[1:]])
        for owner in UPSTREAM_OWNERS:
            rows.append([role, f"({owner})", "", "", "", *syncs(role, lambda k, o=owner: k.split("|")[1] == o)])
        rows.append([role, "scheduler loop, all", "", "", "100", *syncs(role, lambda k: True)])
    both = [100 * sum(_seam_ns(r, role, lambda k: True) for role in ROLES)
            / sum(r["seams"][role]["scheduler_ns"] for role in ROLES) for r in measured]
    rows.append(["both", "all seams / both scheduler loops", "", "", _interval(both, 3), *[""] * len(SYNC_ARMS)])
    return format_table(["role", "seam", "ids", "CPU us/req", "% of scheduler CPU",
                         *(f"syncs/req {b}" for b in SYNC_ARMS.values())], rows)


def plot(runs: list[dict], path: Path, title: str) -> None:
    """A PNG: each seam's CPU us per request (log scale) with its 95 % interval, by role."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server or in CI
    import matplotlib.pyplot as plt

    measured = [r for r in runs if "seams" in r]
    fig, axes = plt.subplots(1, len(ROLES), figsize=(11, 4.8), squeeze=False)
    for ax, role in zip(axes[0], ROLES):
        found = []
        for seam in sorted({k.split("|")[0] for r in measured for k in r["seams"][role]["seams"]}):
            us, _ = _per_request(measured, role, [_seam_ns(r, role, lambda k, s=seam: k.split("|")[0] == s)
                                                  for r in measured])
            mean, half = mean_interval(us)
            if mean > 0:
                found.append((seam, mean, half))
        labels, means, halves = zip(*found) if found else ((), (), ())
        lows = [min(h, m * 0.999) for m, h in zip(means, halves)]  # a log axis has no room below zero
        ax.barh(range(len(found)), means, xerr=[lows, halves], color="tab:blue", capsize=3)
        ax.set_yticks(range(len(found)), labels, fontsize=7)
        ax.set_xscale("log")
        ax.set(title=role, xlabel="CPU us per request (95 % interval)")
        ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_table(runs: list[dict]) -> str:
    """Per role: each arm's process-group CPU per request (median over runs), and the ratios
    hardened/upstream and seams/hardened by run, median with the distribution-free interval."""
    by = {(r["run"], r["arm"]): r for r in runs}
    done = sorted({run for run, _ in by})
    rows = []
    for role in (*ROLES, "both"):
        def per_request(r: dict) -> float:
            return sum(r["group_cpu_ns"][x] for x in (ROLES if role == "both" else (role,))) / r["requests"]

        row = [role]
        for arm in CPU_ARMS:
            ms = sorted(per_request(by[run, arm]) / 1e6 for run in done if (run, arm) in by)
            row.append(f"{ms[len(ms) // 2]:.1f}" if ms else "-")
        for arm, baseline in (("hardened", "upstream"), ("seams", "hardened")):
            ratios = [per_request(by[run, arm]) / per_request(by[run, baseline]) for run in done
                      if (run, arm) in by and (run, baseline) in by]
            if ratios:
                med, lo, hi, coverage = median_interval(ratios)
                row.append(f"{med:.3f} [{lo:.3f}, {hi:.3f}] ({100 * coverage:.2f} %)")
            else:
                row.append("-")
        rows.append(row)
    return format_table(["role", *(f"{a} CPU ms/req" for a in CPU_ARMS), "hardened/upstream", "seams/hardened"],
                        rows)


def merged(saved: list[dict]) -> dict:
    """Several runs' --json (of one base) as one: their runs, each keeping its command."""
    if len({s["base"] for s in saved}) != 1:
        raise SystemExit(f"--report files of one base only, not {sorted({s['base'] for s in saved})}")
    return {**saved[0], "command": " ; ".join(s["command"] for s in saved), "date": max(s["date"] for s in saved),
            "runs": [{**r, "run": (i, r["run"])} for i, s in enumerate(saved) for r in s["runs"]]}


def report(saved: dict) -> None:
    print(f"{saved['base']}, {saved['date']}, {saved['cores']} cores: {saved['command']}")
    runs = saved["runs"]
    if any("seams" in r for r in runs) and any("syncs" in r for r in runs):
        print("per seam: CPU per completed request and its share of the scheduler loop's (every thread the seam "
              "runs on), syncs per completed request on the scheduler loop; mean ± 95 % t half-width over runs")
        print(summary_table(runs))
    if any("seams" in r for r in runs):
        print("per seam and thread: mean ± 95 % t half-width over runs; CPU per completed request, timer's cost "
              "subtracted")
        print(seam_table(runs))
    if any("syncs" in r for r in runs):
        print("syncs on the scheduler loop per completed request (calls that wait for a GPU there; on this CPU, an "
              "upper bound): mean ± 95 % t half-width over runs")
        print(sync_table(runs))
    print("server process groups' CPU per completed request: median over runs; ratios with the "
          "distribution-free interval (its coverage)")
    print(cpu_table(saved["runs"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/bench_seam_cost.py --base 0.5.23 --runs 8 "
                                            "--prompts 32 --concurrency 4 --json seam-cost.json",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--runs", type=int, default=8, help="runs of every arm (default 8)")
    parser.add_argument("--concurrency", type=int, default=4, help="the load generator's --max-concurrency")
    parser.add_argument("--prompts", type=int, default=32, help="completed requests per run (default 32)")
    serving_options(parser)
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--plot", type=Path, help="write a PNG of each seam's CPU per request here")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                        help="print the tables of one or more runs' --json (one base) again, without running")
    args = parser.parse_args(argv)
    if args.report:
        saved = merged([json.loads(path.read_text()) for path in args.report])
        report(saved)
        if args.plot:
            plot(saved["runs"], args.plot, f"{saved['base']}, {saved['date']}: {saved['command']}")
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS) or args.runs < 1 or args.prompts < 1 or args.warmup < 0:
        parser.error(f"--arms from {', '.join(ARMS)}; --runs and --prompts at least 1, --warmup at least 0")
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    seams = seam_list(args.base)
    order = [(run, arm) for run in range(args.runs) for arm in random.Random(args.seed + run).sample(arms, len(arms))]
    saved = {"base": args.base, "command": command, "cores": os.cpu_count(), "arms": arms, "runs": []}
    began = time.monotonic()
    for i, (run, arm) in enumerate(order, 1):
        print(f"[{i}/{len(order)}] run {run + 1} {arm} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        saved["runs"].append(one_cluster(args.base, arm, args, run, seams))
        saved["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if args.json:  # after every cluster: a run that fails later keeps what it measured
            args.json.write_text(json.dumps(saved, indent=1))
    report(saved)
    if args.plot and any("seams" in r for r in saved["runs"]):
        plot(saved["runs"], args.plot, f"{saved['base']}, {saved['date']}: {command}")


if __name__ == "__main__":
    main()
