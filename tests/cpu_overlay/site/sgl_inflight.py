"""The scheduler's event loop, as the scheduler runs it, and a batch still in flight (test
instrumentation, wired by the overlay's one edit before upstream's ``dispatch_event_loop``).

**Which loop runs.** ``install`` wraps every ``event_loop*`` method on the scheduler object, so
the loop upstream's own dispatch picks (from ``disable_overlap_schedule``, the PP size, the PD
mode: what the arguments say is not what is asked) logs ``LOOP`` with its name on entry. Every
base, every cluster.

**A batch in flight** (``SANDBOX_INFLIGHT_S`` set: ``sandbox up --inflight``). On a GPU the
overlap loops (0.5.23: ``event_loop_overlap_disagg_prefill`` and ``_decode`` in
``disaggregation/``, ``event_loop_overlap`` in ``managers/scheduler.py``) launch batch k, then
process batch k-1's result, then run the PD queues (decode: preallocation, transfers, H3's and
H8's checks, H13's gate, H5's releases before the next launch; prefill: the inflight queue and
its releases) while batch k still runs. The worker's ``forward_batch_generation`` returns once
the kernels are queued; the scheduler then queues the result's device-to-host copy on its copy
stream (``_copy_result_to_cpu``, ``copy_to_cpu``: non-blocking copies) and records
``batch_result.copy_done = self.device_module.Event()`` behind them. That event is the one
place the loop learns the batch ended: ``process_batch_result*`` calls
``copy_done.synchronize()`` before it reads a token, and prefill's continuous polling asks
``copy_done.query()``. On CPU ``device_module`` is ``torch.cpu``, whose event is done when
recorded: every forward has finished before the loop goes on, so no seam ever ran beside an
unfinished batch.

The narrowest stand-in keeps upstream's loops, worker and copies as they are and replaces only
that event: the scheduler's ``device_module`` becomes ``torch.cpu`` with an ``Event`` that is
done ``SANDBOX_INFLIGHT_S`` after it was recorded, as a GPU's is once the batch and its copies
have run. ``query()`` says False until then and ``synchronize()`` blocks until then, so batch k's
result reaches the scheduler only after the loop has gone on past it: the PD queues' seams run
with the batch unfinished, in upstream's order. What it does not stand in for: the forward's KV
writes and the host copies themselves land at once (on CPU they are plain host writes), so a
seam that read a result before its event would read the finished value where a GPU would read a
stale buffer (upstream reads none before ``copy_done``). Not chosen: running the forward on a
thread that finishes later (a CUDA stream's asynchrony), because on CPU the scheduler's host-side
writes to the batch's tensors would then race the forward, which stream ordering prevents on a
GPU; the result would be a different program, not a later one.

``pending()`` counts this process's recorded events not yet done; the page ledger stamps it on
decode's records, so a test can see a release or an exposure happen beside an unfinished batch.
``WAITED`` is logged the first time the loop asked for a result still in flight: a cluster in
this mode that never logs it did not run in it, and its start fails.
"""

from __future__ import annotations

import os
import sys
import threading
import time

DELAY_ENV = "SANDBOX_INFLIGHT_S"
LOOP = "SANDBOX EVENT LOOP"  # + ": <name>"
ON = "SANDBOX IN FLIGHT: each batch's result released"  # + " <s> s after its forward returns"
WAITED = "SANDBOX IN FLIGHT: the loop went on past an unfinished batch"

_lock = threading.Lock()
_due: list[float] = []  # recorded events' due times, not yet past (pending() prunes)
_waited = False


def _say(line: str) -> None:
    print(f"{line} (pid {os.getpid()})", file=sys.stderr, flush=True)


def pending() -> int:
    """How many batches of this process are still in flight (recorded, not yet done)."""
    now = time.monotonic()
    with _lock:
        _due[:] = [t for t in _due if t > now]
        return len(_due)


def _went_on() -> None:
    global _waited
    if not _waited:
        _waited = True
        _say(WAITED)


class _DelayedEvent:
    """``copy_done`` as on a GPU: done ``delay_s`` after ``record``, not at once."""

    delay_s = 0.0

    def __init__(self, *args, **kwargs) -> None:
        self._due: float | None = None  # never recorded: done, as a CUDA event is

    def record(self, stream=None) -> None:
        self._due = time.monotonic() + self.delay_s
        with _lock:
            _due.append(self._due)

    def query(self) -> bool:
        done = self._due is None or time.monotonic() >= self._due
        if not done:
            _went_on()
        return done

    def synchronize(self) -> None:
        left = 0.0 if self._due is None else self._due - time.monotonic()
        if left > 0:
            _went_on()
            time.sleep(left)

    def wait(self, stream=None) -> None:
        """A stream waiting on the event: no kernel runs here, so nothing is queued behind it."""


class _DeviceModule:
    """``torch.cpu`` with the delayed event."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.Event = _DelayedEvent

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _recorded(name: str, loop):
    def run(*args, **kwargs):
        _say(f"{LOOP}: {name}")
        return loop(*args, **kwargs)
    return run


def install(scheduler) -> None:
    """Log the loop upstream's dispatch calls; in flight mode, delay the scheduler's events."""
    for name in dir(type(scheduler)):
        if name.startswith("event_loop"):
            setattr(scheduler, name, _recorded(name, getattr(scheduler, name)))
    delay = float(os.environ.get(DELAY_ENV) or 0)
    if delay > 0:
        _DelayedEvent.delay_s = delay
        scheduler.device_module = _DeviceModule(scheduler.device_module)
        _say(f"{ON} {delay:g} s after its forward returns")
