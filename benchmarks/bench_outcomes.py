"""H4's outcomes route under its followers: threads, memory and latency as decode ranks follow one prefill.

    python benchmarks/bench_outcomes.py --followers 1,8,32 --rate 50 --seconds 10 --plot h4.png

The prefill side is the runtime's own route (`outcomes.add_routes` on an
aiohttp app, as the bootstrap server serves it) in this process; the
followers are decode ranks simulated in a second process, each one thread
running the decode side's own poll (`get_json` and `parse_reply` on the
route, as `_watch` does). Prefill ends --rate requests a second for
--seconds; for each follower count: the serving process's threads and RSS
(against the same process with no follower, measured first), its CPU share
over the run, and the latency from an outcome's note to its arrival at every
follower (p50, p99, max). Upstream has no route: a decode learns of prefill's
rejection at its waiting timeout (300 s), which is what these latencies replace.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from cli_args import ints  # benchmarks/ is on sys.path when run as a script
from growth_plot import plot_growth
from stats import quantile

from sglang_hardened.common.table import format_table
from sglang_hardened.runtime import outcomes
from sglang_hardened.runtime.outcomes import LONG_POLL_S, OUTCOMES_ROUTE, REPLY_MAX, OutcomeLog, parse_reply
from sglang_hardened.runtime.peer_json import get_json

LAST_ROOM = -1  # the outcome that tells followers the run is over (rooms are otherwise >= 0)


def _proc_status(field: str) -> int:
    """A number from this process's /proc status (Threads, VmRSS in KiB)."""
    line = next(x for x in open("/proc/self/status").read().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1])


def serve() -> int:
    """Start the route on an event loop thread (as the bootstrap server runs it); its port."""
    from aiohttp import web

    app = web.Application()
    outcomes.add_routes(app)
    ready: list[int] = []
    started = threading.Event()

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ready.append(site._server.sockets[0].getsockname()[1])
        started.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(run()), name="bootstrap-server", daemon=True).start()
    started.wait(10)
    return ready[0]


def follow(port: int, count: int, out: mp.Queue) -> None:
    """A decode process with `count` followers; sends back {room: [arrival times]} once each saw LAST_ROOM."""
    arrivals: dict[int, list[float]] = {}
    lock = threading.Lock()

    def one() -> None:
        seq, done = -1, False
        while not done:
            reply = get_json(urllib.request.Request(f"http://127.0.0.1:{port}{OUTCOMES_ROUTE}?after={seq}"),
                             LONG_POLL_S + 10, REPLY_MAX)
            at = time.monotonic()  # one clock for both processes: CLOCK_MONOTONIC is the host's
            seq, items = parse_reply(reply)
            with lock:
                for room, _, _ in items:
                    arrivals.setdefault(room, []).append(at)
                    done |= room == LAST_ROOM

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(arrivals)


def run_setting(port: int, count: int, rate: float, seconds: float) -> dict:
    """One follower count: the serving process's threads, RSS and CPU, and every arrival's latency."""
    outcomes.OUTCOMES = log = OutcomeLog()  # the route reads it per poll: each setting starts empty
    out: mp.Queue = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=follow, args=(port, count, out), daemon=True)
    child.start()
    time.sleep(2.0)  # the followers' first polls are waiting
    noted: dict[int, float] = {}
    cpu0, wall0 = time.process_time(), time.monotonic()
    for room in range(int(rate * seconds)):
        time.sleep(max(0.0, wall0 + room / rate - time.monotonic()))
        noted[room] = time.monotonic()
        log.add(room, 400, "Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens).")
    threads, rss_kib = _proc_status("Threads"), _proc_status("VmRSS")
    cpu = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    log.add(LAST_ROOM, 500, "end of the run")
    arrivals = out.get(timeout=LONG_POLL_S + 30)
    child.join(10)
    latencies = sorted(at - noted[room] for room, ats in arrivals.items() if room != LAST_ROOM for at in ats)
    missing = count * len(noted) - len(latencies)
    if missing:
        raise SystemExit(f"{missing} outcome arrivals missing with {count} followers")
    return {"threads": threads, "rss_kib": rss_kib, "cpu": cpu, "latencies": latencies}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/bench_outcomes.py --followers 1,8,32")
    parser.add_argument("--followers", type=ints, default=[1, 8, 32], help="follower counts, comma-separated")
    parser.add_argument("--rate", type=float, default=50.0, help="outcomes prefill notes per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each setting notes outcomes")
    parser.add_argument("--plot", type=Path, help="a PNG of the latencies against the follower count")
    args = parser.parse_args(argv)
    port = serve()
    idle_threads, idle_rss = _proc_status("Threads"), _proc_status("VmRSS")
    rows, series = [], {"p50": [], "p99": [], "max": []}
    for count in args.followers:
        r = run_setting(port, count, args.rate, args.seconds)
        lat = r["latencies"]
        p50, p99, worst = statistics.median(lat), quantile(lat, 0.99), lat[-1]
        for label, value in zip(series, (p50, p99, worst)):
            series[label].append((count, value * 1e3))
        rows.append((str(count), f"{r['threads']} ({r['threads'] - idle_threads:+d})",
                     f"{r['rss_kib'] / 1024:.1f} ({(r['rss_kib'] - idle_rss) / 1024:+.1f})", f"{r['cpu'] * 100:.1f} %",
                     f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{worst * 1e3:.2f}", str(len(lat))))
        print(f"{count} followers done", flush=True)
    print(f"prefill notes {args.rate:.0f} outcomes/s for {args.seconds:.0f} s; followers in another process, "
          f"one thread each; serving process idle: {idle_threads} threads, {idle_rss / 1024:.1f} MiB; "
          f"host load {os.getloadavg()[0]:.1f}")
    print(format_table(("followers", "server threads", "server RSS MiB", "server CPU", "p50 ms", "p99 ms",
                        "max ms", "arrivals"), rows))
    if args.plot:
        plot_growth(args.plot, "H4: an outcome's way to every follower", "decode ranks following one prefill",
                    "milliseconds from prefill's note", series)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
