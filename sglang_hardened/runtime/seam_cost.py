"""What each hardening seam costs the thread it runs on, inside a running server.

The end-to-end A/B cannot resolve one percent on a shared machine (docs/performance.md); the
seams' own CPU time can be measured where they run. With ``SGLANG_HARDENED_SEAM_COST_DIR``
naming a directory that holds ``seams.json`` (the seams to time, ``{"module.function": [ids]}``:
benchmarks/bench_seam_cost.py writes it from pipeline/seams.py's reading of the series, the one
list of seams), every process that imports the runtime replaces those functions, and the one
path every metric write takes, with timed wrappers, and writes its totals to ``<dir>/<pid>.json``
every ``write_every_s`` (``limits: seam_cost`` in policy.yaml) and at exit (a forked child, as
the CPU sandbox starts SGLang's schedulers, writes its own from the fork on). Per seam and thread
kind (the process's main thread, which in a scheduler process runs the scheduler's loop, or
another): its calls and thread CPU time (``time.thread_time_ns``), exclusive of the seams it
calls, so the seams' sum is their total. Beside them the main thread's and the process's CPU
time, read at the same instant, and the timer's own cost per call measured at start, for a
reader to subtract. The patches call every seam through its module (``hardened_x.f(...)``),
so replacing the module's attribute reaches every call. Unset (the default), nothing is
wrapped or started: the seams are the original functions.

No new network surface: the files are written with the server's own user into a directory
the operator names, and say nothing but seam names, counts and times.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..common.knobs import SEAM_COST_DIR

SEAMS_FILE = "seams.json"
METRICS_SEAM = "metrics._write"  # every metric write goes through it (runtime/metrics.py)
WRAPPED = "__sglang_hardened_seam__"  # set on a wrapper: the seam it times
CALIBRATION_CALLS = 2000

log = logging.getLogger("sglang_hardened")

Sums = dict[tuple[str, bool], tuple[int, int]]  # (seam, on the main thread) -> (calls, cpu ns)


class _Thread(threading.local):
    """One thread's sums (no lock on the timed path) and its stack of child times."""

    def __init__(self) -> None:
        self.sums: Sums = {}
        self.children: list[int] = []
        self.main = threading.current_thread() is threading.main_thread()
        _ALL_SUMS.append(self.sums)  # list.append is atomic: the writer sums every thread's


_ALL_SUMS: list[Sums] = []
_THREAD = _Thread()


def _run(seam: str | None, calls: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its thread CPU time added to ``seam``'s sums (with ``calls`` more
    calls), less that of timed calls it makes; what it returns or raises passes through. ``None``:
    upstream's own work called from inside a seam, taken out of the seam's time and kept nowhere."""
    here = _THREAD
    here.children.append(0)
    start = time.thread_time_ns()
    try:
        return fn(*args, **kwargs)
    finally:
        spent = time.thread_time_ns() - start
        inner = here.children.pop()
        if here.children:
            here.children[-1] += spent
        if seam is not None:
            count, ns = here.sums.get((seam, here.main), (0, 0))
            here.sums[seam, here.main] = (count + calls, ns + spent - inner)


class _TimedContext:
    """A seam that is a context manager around upstream's own work (H12's): its entry and exit
    are the seam's cost, the body between them is upstream's."""

    def __init__(self, seam: str, context: Any) -> None:
        self.seam, self.context = seam, context

    def __enter__(self) -> Any:
        return _run(self.seam, 0, self.context.__enter__)

    def __exit__(self, *exc: Any) -> Any:
        return _run(self.seam, 0, self.context.__exit__, *exc)


def timed(seam: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` counted and timed as ``seam`` on the thread that calls it (for a context manager
    function, the making, entry and exit of its context). A bound method upstream passes in is
    upstream's own work the seam calls (H6's Mooncake write, H8's message parser): its time is not
    the seam's."""
    context = inspect.isgeneratorfunction(inspect.unwrap(fn)) and not inspect.isgeneratorfunction(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(functools.partial(_run, None, 0, a) if inspect.ismethod(a) else a for a in args)
        made = _run(seam, 1, fn, *args, **kwargs)
        return _TimedContext(seam, made) if context else made

    setattr(wrapper, WRAPPED, seam)
    return wrapper


def totals() -> Sums:
    """Every thread's sums in this process, added up."""
    found: Sums = {}
    for sums in list(_ALL_SUMS):
        for key, (calls, ns) in dict(sums).items():  # dict() copies under the GIL: a consistent view
            old = found.get(key, (0, 0))
            found[key] = (old[0] + calls, old[1] + ns)
    return found


def calibrate(calls: int = CALIBRATION_CALLS) -> dict[str, float]:
    """The timer's cost on this thread, per call: what it records for a call that does nothing
    (``recorded_ns``: to subtract from each seam, times its calls) and what it adds to the thread
    in all (``added_ns``: to subtract from the scheduler's own time, times its calls)."""

    def nothing() -> None:
        return None

    probe = timed("calibration", nothing)
    bare_start = time.thread_time_ns()
    for _ in range(calls):
        nothing()
    bare = time.thread_time_ns() - bare_start
    start = time.thread_time_ns()
    for _ in range(calls):
        probe()
    spent = time.thread_time_ns() - start
    recorded = _THREAD.sums.pop(("calibration", _THREAD.main))[1]
    return {"recorded_ns": recorded / calls, "added_ns": max(spent - bare, 0) / calls}


def _write_every_s() -> float:
    from .policy import load_limits

    return float(load_limits("seam_cost")["write_every_s"])


class Report:
    """This process's totals file, written every ``every_s`` by a daemon thread."""

    def __init__(self, folder: Path, seams: Mapping[str, list[str]], every_s: float) -> None:
        self.path = folder / f"{os.getpid()}.json"
        self.seams, self.every_s = seams, every_s
        self.timer = calibrate()
        self._main_clock = time.pthread_getcpuclockid(threading.main_thread().ident or 0)
        self._failed = False
        self._lock = threading.Lock()  # the writer thread and a last write at exit share one staging file
        threading.Thread(target=self._run, name="sglang-hardened-seam-cost", daemon=True).start()

    def snapshot(self) -> dict[str, Any]:
        """The totals now, with the main thread's and the process's CPU read at the same instant."""
        return {
            "pid": os.getpid(),
            "title": Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"),
            "written_at": time.time(),
            "main_cpu_ns": time.clock_gettime_ns(self._main_clock),
            "process_cpu_ns": time.process_time_ns(),
            "timer": self.timer,
            "seams": [{"seam": seam, "ids": self.seams.get(seam, ["metrics"]), "main_thread": main,
                       "calls": calls, "cpu_ns": ns} for (seam, main), (calls, ns) in sorted(totals().items())],
        }

    def write(self) -> None:
        """Replace the file whole (a reader never sees half of one); a failure is logged once."""
        staged = self.path.with_suffix(".tmp")
        try:
            with self._lock:
                staged.write_text(json.dumps(self.snapshot()))
                os.replace(staged, self.path)
        except OSError as e:
            if not self._failed:
                log.warning("sglang-hardened: seam costs could not be written to %s: %s", self.path, e)
            self._failed = True

    def _run(self) -> None:
        while True:
            self.write()
            time.sleep(self.every_s)


_report: Report | None = None


def _forked() -> None:
    """In a forked child (SGLang's schedulers where the start method is fork): the wrappers came
    along, the writer thread and the other threads did not; count afresh in a file of its own."""
    global _report
    if _report is None:  # switched off again in this process (the unit tests)
        return
    _THREAD.sums.clear()
    _THREAD.main = True  # the forking thread is the child's main thread
    _ALL_SUMS[:] = [_THREAD.sums]
    _report = Report(_report.path.parent, _report.seams, _report.every_s)


def _at_exit() -> None:
    if _report is not None:
        _report.write()


def install(environ: Mapping[str, str] = os.environ) -> Report | None:
    """When the switch names a directory, wrap every seam it lists (and metric writes) and start
    writing this process's totals there; otherwise do nothing. A directory without a readable
    list stops the process here, naming it: a measurement must not silently time nothing."""
    global _report
    folder = SEAM_COST_DIR.get(environ)
    if not folder:
        return None
    try:
        seams: dict[str, list[str]] = json.loads((Path(folder) / SEAMS_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{SEAM_COST_DIR.name}={folder!r}: no readable {SEAMS_FILE} there ({e})") from None
    for seam in [*seams, METRICS_SEAM]:
        module_name, name = seam.rsplit(".", 1)  # a module under runtime may be dotted (page_tags.seams)
        module = importlib.import_module(f"{__package__}.{module_name}")
        original = getattr(module, name)
        if not hasattr(original, WRAPPED):  # a second install wraps nothing twice
            setattr(module, name, timed(seam, original))
    if _report is None:
        os.register_at_fork(after_in_child=_forked)
        atexit.register(_at_exit)
    _report = Report(Path(folder), seams, _write_every_s())
    return _report
