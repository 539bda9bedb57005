"""H8's own cost where it runs: each tag operation's time, logged every so many requests.

Benchmarks time the tag operations on their own; what an operator needs is what
they cost inside the server, between the scheduler's own work (cold caches,
the page indices SGLang's allocator hands out), next to the step they protect.
With `SGLANG_HARDENED_PAGE_TAGS_COST_EVERY=N` (default: `limits: H8` in the
policy file, 0 = off), every N requests (decode counts releases, the last tag
operation of a request; prefill counts stamps, one per chunk sent to one
destination) one line gives each operation's means per request: wall time
(what it delays the thread by: it includes waits for the GIL, which torch
gives up in every op, and for a busy CPU) and the thread's CPU time (what it
consumes), with the pages it covered; then the window starts again. The timers
cost about 1 us per operation; on CUDA they time the host's side: the
launches, and the check's one device-to-host sync. With `--enable-metrics`
each operation's wall time also goes into a histogram (runtime/metrics.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from ...common.knobs import PAGE_TAGS_COST_EVERY
from .. import metrics


log = logging.getLogger("sglang_hardened")

Start = tuple[int, int] | None  # (perf_counter_ns, thread_time_ns) when metering, else None


def cost_report_every() -> int:
    """Requests per cost line in this process: the env var, else the policy's default; 0 is off.
    Read when the tags are made (server start-up), so a bad value stops the server there."""
    from ..policy import knob_value

    return knob_value(PAGE_TAGS_COST_EVERY)


@dataclass
class OpCost:
    """One operation's sums over a window."""

    wall_ns: int = 0
    cpu_ns: int = 0
    requests: int = 0
    pages: int = 0


class CostMeter:
    """Sums one side's tag operations and logs their means every `every` `unit`s (request, send).

    Prefill's transfer workers (one thread per queue) stamp at once: the sums and
    the window's end are under a lock, taken only while metering.
    """

    def __init__(self, role: str, closing_op: str, unit: str, every: int | None = None) -> None:
        self.role, self.closing_op, self.unit = role, closing_op, unit
        self.every = cost_report_every() if every is None else every
        self.ops: defaultdict[str, OpCost] = defaultdict(OpCost)
        self._lock = threading.Lock()

    def start(self) -> Start:
        """Read the clocks before an operation (nothing when off)."""
        return (time.perf_counter_ns(), time.thread_time_ns()) if self.every else None

    def add(self, op: str, start: Start, requests: int, pages: int) -> None:
        """`op` ran from `start` until now, for these requests and pages."""
        if start is None:
            return
        cpu_ns, wall_ns = time.thread_time_ns() - start[1], time.perf_counter_ns() - start[0]
        metrics.tag_op(self.role, op, wall_ns / 1e9)
        with self._lock:
            cost = self.ops[op]
            cost.cpu_ns += cpu_ns
            cost.wall_ns += wall_ns
            cost.requests += requests
            cost.pages += pages
            if op != self.closing_op or cost.requests < self.every:  # closed after the op: its time is in
                return
            line = self.line()
            self.ops.clear()
        log.info("%s", line)

    def line(self) -> str:
        """The window's means, e.g. `sglang-hardened H8 cost (decode, 1000 requests): allocate
        9.2 us wall, 5.1 us cpu, 512 pages; check ...; release ... per request`."""
        parts = "; ".join(f"{op} {c.wall_ns / 1e3 / n:.1f} us wall, {c.cpu_ns / 1e3 / n:.1f} us cpu, "
                          f"{c.pages / n:.0f} pages" for op, c in self.ops.items() if (n := max(c.requests, 1)))
        count = self.ops[self.closing_op].requests
        return f"sglang-hardened H8 cost ({self.role}, {count} {self.unit}s): {parts} per {self.unit}"


_LINE = re.compile(r"sglang-hardened H8 cost \((\w+), (\d+) \w+\): (.*) per \w+")
_PART = re.compile(r"(\w+) ([\d.]+) us wall, ([\d.]+) us cpu, (\d+) pages")


@dataclass(frozen=True)
class CostLine:
    """One logged window, read back from a server's log: per operation, its means per unit."""

    role: str
    count: int
    wall_us: dict[str, float]
    cpu_us: dict[str, float]
    pages: dict[str, int]


def read_cost_lines(log_text: str) -> list[CostLine]:
    """Every cost line in a log, in order."""
    lines = []
    for role, count, parts in _LINE.findall(log_text):
        ops = _PART.findall(parts)
        lines.append(CostLine(role, int(count), {op: float(w) for op, w, _, _ in ops},
                              {op: float(c) for op, _, c, _ in ops}, {op: int(p) for op, _, _, p in ops}))
    return lines
