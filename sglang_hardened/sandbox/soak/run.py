"""A soak on a running instrumented cluster: clients, faults, then the end checks (pages
back to idle on every server, the ledger clean, no process of a killed server left, memory)."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

from ...operations.filler import counter
from ...runtime.source_hold import HOLD_TIMEOUTS
from ..cluster import Cluster, marked_pids
from ..instruments import Instruments
from ..ledger import Ledger, UnsafeFree
from .catalogue import build
from .faults import Injector, group_pids
from .judge import judge
from .plan import SoakPlan
from .report import Rss, SoakReport
from .traffic import send

PROGRESS_EVERY_S = 10.0
BACKOFF_S = 0.5  # a client whose request failed waits this long, as real clients back off (not a tight loop on a down server)
SETTLE_EXTRA_S = 10.0  # beyond the holds' longest (HOLD_TIMEOUTS release timeouts and a slowed write)
HANG_MARGIN_S = 5.0  # a client gives up this long after its bound: its request is a hang by then
MAX_WAIT_BOUNDS = 4  # however the faults stack, no client waits longer than this many bounds


def rss_mib(leader: int, field: str = "VmRSS") -> float:
    """Resident memory of a server's whole process group: now (VmRSS), or each process's peak
    summed (VmHWM)."""
    total_kib = 0
    for pid in group_pids(leader):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith(f"{field}:")), 0)
    return total_kib / 1024


def run_soak(cluster: Cluster, plan: SoakPlan, restart: Callable[[str], None] | None = None,
             progress: Callable[[str], None] = lambda line: None, instruments: Instruments | None = None) -> SoakReport:
    """Drive ``plan`` against ``cluster`` and judge every request and page; never raises on a
    finding. ``restart`` brings a killed server back (default: ``cluster.restart``);
    ``instruments``: the files the cluster's servers were started with (default: its own,
    ``sandbox up --instrument``). A server that will not restart raises RestartFailed once
    every fault has ended."""
    plan.validate()
    injector = Injector(cluster, plan, restart or cluster.restart, instruments or cluster.instruments)
    began = time.monotonic()
    cat = build(cluster.lb_url, counter(cluster.prefill_url, plan.bound_s), cluster.params,
                plan.seed, plan.bound_s, [k for k, w in plan.mix.items() if w > 0])
    idle = cluster.used_tokens()
    rss_start = {name: rss_mib(cluster.procs[name].pid) for name in injector.servers()}
    p = cluster.params
    report = SoakReport({"base": p.base, "backend": p.backend, "lb": p.lb, "servers": f"{p.prefills}x{p.decodes}"},
                        plan.seed, bound_s=plan.bound_s)
    lock = threading.Lock()
    end = time.monotonic() + plan.duration_s

    def give_up(sent_at: float) -> bool:
        now = time.monotonic()
        return now - max(sent_at, injector.calm_at(sent_at, now) or sent_at) > plan.bound_s + HANG_MARGIN_S

    def client(c: int) -> None:
        i = 0
        while time.monotonic() < end and injector.error is None:
            step = plan.step(c, i)
            i += 1
            rid = f"soak-{uuid.uuid4().hex}"
            injector.fire(step, rid)
            sent = send(cluster.lb_url, step, cat, rid, MAX_WAIT_BOUNDS * plan.bound_s,
                        step.fault_after_s if step.fault == "disconnect" else None, give_up)
            outcome = judge(step, sent, cat, plan.bound_s, injector.calm_at(sent.sent_at, sent.sent_at + sent.seconds))
            with lock:
                report.outcomes.append(outcome)
            if outcome.violation:  # at once: a long run's reader need not wait for the end to see it
                progress(f"VIOLATION {outcome.verdict}: client {c} #{i - 1} {step.kind}"
                         f"{f' ({step.fault})' if step.fault else ''}: {outcome.detail}")
            if outcome.verdict not in ("ok", "refused", "hung-up"):
                time.sleep(BACKOFF_S)

    clients = [threading.Thread(target=client, args=(c,), daemon=True, name=f"soak-client-{c}") for c in range(plan.clients)]
    for t in clients:
        t.start()
    while any(t.is_alive() for t in clients):
        for t in clients:
            t.join(PROGRESS_EVERY_S / len(clients))
        with lock:
            bad = sum(o.violation for o in report.outcomes)
            progress(f"{time.monotonic() - began:5.0f} s  requests {len(report.outcomes)}  "
                     f"faults {len(injector.events)}  violations so far {bad}")
    injector.finish(plan.bound_s + injector.longest_s)  # a kill or a roll drawn near the end restarts its servers
    if injector.error:
        raise injector.error
    report.faults = sorted(injector.events, key=lambda f: f.at)
    report.end_violations = _end_checks(cluster, injector, idle, plan, began)
    restarted = {name for f in report.faults if f.landed and f.name.startswith(("kill-", "rolling-")) for name in f.targets}
    report.rss = {name: Rss(rss_start[name], rss_mib(cluster.procs[name].pid), name in restarted) for name in rss_start}
    report.seconds = time.monotonic() - began
    return report


def _end_checks(cluster: Cluster, injector: Injector, idle: dict[str, int], plan: SoakPlan,
                began: float) -> list[tuple[str, str]]:
    found = []
    settle_s = HOLD_TIMEOUTS * plan.release_timeout_s + injector.instruments.slow_s + SETTLE_EXTRA_S
    deadline = time.monotonic() + settle_s
    try:
        while (used := cluster.used_tokens()) != idle and time.monotonic() < deadline:
            time.sleep(0.5)
    except OSError as e:  # a server that died by itself (or never came back): the rest is still judged
        found.append(("server-down", f"a server did not answer /v1/loads after the last request: {e}"))
    else:
        if used != idle:
            found.append(("pages-not-idle", f"KV tokens held {used} where idle held {idle}, {settle_s:.0f} s after "
                                            "the last request"))
    ledger = Ledger(injector.instruments.ledger_dir)
    found += [("page-freed-under-write", f"decode {line}") for line in _by_room(ledger.unsafe_frees(killed=injector.killed), began)]
    # a prefill page freed under a write into a decode killed meanwhile: nobody reads what it sends
    into = defaultdict(set)  # room -> the decode processes its pages were taken in
    for e in ledger.of("expose"):
        into[e["room"]].add(e["pid"])
    source = [u for u in ledger.unsafe_source_frees(killed=injector.killed)
              if not any(u.write_begin <= injector.killed.get(pid, -math.inf) <= u.freed_at for pid in into[u.room])]
    found += [("source-freed-under-write", f"prefill {line}") for line in _by_room(source, began)]
    live = {pid for proc in cluster.procs.values() for pid in group_pids(proc.pid)}
    found += [("process-leaked", f"process {pid} of the sandbox outlived its server")
              for pid in marked_pids(cluster.run_id) if pid not in live]
    return found


def _by_room(unsafe: list[UnsafeFree], since: float) -> list[str]:
    """One finding per room (a transfer's pages go together), since the soak began."""
    rooms: dict[int, list[UnsafeFree]] = {}
    for u in unsafe:
        if u.freed_at >= since:
            rooms.setdefault(u.room, []).append(u)
    return [f"room {room}: {len(us)} pages freed while a write into them was in flight "
            f"(it returned up to {max(u.write_end - u.freed_at for u in us):.1f} s later)" for room, us in rooms.items()]
