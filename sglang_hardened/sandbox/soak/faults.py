"""Faults injected into a running sandbox, each from its own thread at its request's
chosen moment: aborts, stops, kills with a restart, and transfers failing part-way.

Server faults run one at a time (a second one drawn meanwhile is skipped and counted):
two stops at once would measure the release timeout twice over, not a new failure.
While a fault waits to land, the cluster's write calls are slowed (the instruments'
switch), and a server fault waits for a write to be in flight (the ledger shows it
begun and not ended) before it lands, so it hits a transfer as often as the traffic allows.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..cluster import Cluster, signal_group
from ..env import SandboxError
from ..instruments import Instruments
from .plan import SERVER_FAULTS, SoakPlan, Step

AIM_S = 3.0  # how long a server fault waits for a write in flight before it lands anyway
FAIL_WINDOW_S = 3.0  # how long transfers fail part-way
PART_WAY_FAULT = "fail-part-way"  # the overlay's fault name (tests/cpu_overlay/site/sgl_faults.py)


class RestartFailed(SandboxError):
    """A killed server did not come back: the soak cannot go on, and its cluster is half gone."""


@dataclass(frozen=True)
class FaultEvent:
    name: str
    at: float  # time.monotonic() when it landed (or was skipped)
    seconds: float  # how long it was in effect
    landed: bool
    note: str


def group_pids(leader: int) -> list[int]:
    """Every live process of a server's process group (its scheduler and detokenizer too)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == leader:
                found.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


class _OpenWrites:
    """The ledger read as it grows: which writes have begun and not ended."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.offsets, self.open = folder, {}, set()

    def any(self, killed: Mapping[str, float]) -> bool:
        """Whether a write is in flight; those of a killed writer (its pid) ended at its kill."""
        for f in self.folder.glob("*.jsonl"):
            with f.open() as lines:
                lines.seek(self.offsets.get(f, 0))
                for line in iter(lines.readline, ""):
                    if not line.endswith("\n"):
                        break  # a line still being written: read it next time
                    self.offsets[f] = lines.tell()
                    e = json.loads(line)
                    if e["ev"] == "begin":
                        self.open.add((f.stem, e["w"]))
                    elif e["ev"] == "end":
                        self.open.discard((f.stem, e["w"])) if "w" in e else self._end_oldest(f.stem)
        self.open = {(pid, w) for pid, w in self.open if pid not in killed}
        return bool(self.open)

    def _end_oldest(self, pid: str) -> None:
        mine = sorted(w for p, w in self.open if p == pid)
        if mine:
            self.open.discard((pid, mine[0]))


class Injector:
    """Lands each step's fault; remembers what landed, when, and which writers it killed."""

    def __init__(self, cluster: Cluster, plan: SoakPlan, restart: Callable[[str], None],
                 instruments: Instruments | None) -> None:
        if instruments is None:
            raise SandboxError("the soak needs an instrumented cluster (`sandbox up ... --instrument`): "
                               "the page ledger judges it and the fault hooks inject its transfer faults")
        self.cluster, self.plan, self.restart = cluster, plan, restart
        self.instruments = instruments
        self.events: list[FaultEvent] = []
        self.windows: list[list[float]] = []  # [from, to] a server fault was in effect (to: inf while it is)
        self.killed: dict[str, float] = {}  # a killed writer's pid (the ledger's file name) -> when
        self.decode_kills: list[float] = []  # when decode was killed: writes into it then read for no one
        self.error: RestartFailed | None = None  # a server that would not restart: the soak stops
        self._server = threading.Lock()
        self._lock = threading.Lock()
        self._slowing = 0
        self._writes = _OpenWrites(self.instruments.ledger_dir)
        self._threads: list[threading.Thread] = []

    def fire(self, step: Step, rid: str) -> None:
        """Land ``step``'s fault from its own thread (a client hang-up is the client's own)."""
        if step.fault and step.fault != "disconnect":
            t = threading.Thread(target=self._land, args=(step, rid), daemon=True, name=f"fault-{step.fault}")
            self._threads.append(t)
            t.start()

    def calm_at(self, start: float, end: float) -> float | None:
        """When the last server fault in effect between ``start`` and ``end`` ended (``end`` if
        one still is); None if none was. Back-to-back faults stack: a request's bound runs from here."""
        ends = [min(b, end) for a, b in list(self.windows) if a <= end and start <= b]
        return max(ends) if ends else None

    def finish(self, timeout_s: float) -> None:
        """Wait for every fault to end; whatever happens, no server is left stopped."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for role in ("prefill", "decode"):
            signal_group(self.cluster.procs[role].pid, signal.SIGCONT)

    def _record(self, step: Step, at: float, landed: bool, note: str) -> None:
        with self._lock:
            self.events.append(FaultEvent(step.fault, at, time.monotonic() - at, landed, note))

    @contextmanager
    def _slowed(self):
        with self._lock:
            self._slowing += 1
            self.instruments.slow_switch.touch()
        try:
            yield
        finally:
            with self._lock:
                self._slowing -= 1
                if not self._slowing:
                    self.instruments.slow_switch.unlink(missing_ok=True)

    def _land(self, step: Step, rid: str) -> None:
        if step.fault not in SERVER_FAULTS:
            with self._slowed():
                time.sleep(step.fault_after_s)
                at = time.monotonic()
                self._record(step, at, *_abort(self.cluster.procs[step.fault.split("-")[1]].url, rid))
            return
        if not self._server.acquire(blocking=False):
            self._record(step, time.monotonic(), False, "skipped: another server fault was in effect")
            return
        try:
            with self._slowed():  # only until it lands: a write already slowed stays so
                time.sleep(step.fault_after_s)
                aim_until = time.monotonic() + AIM_S
                while not self._writes.any(self.killed) and time.monotonic() < aim_until:
                    time.sleep(0.1)
            at = time.monotonic()
            window = [at, math.inf]
            self.windows.append(window)
            try:
                note = self._server_fault(step)
            finally:
                window[1] = time.monotonic()
            self._record(step, at, True, note)
        except RestartFailed as e:
            self.error = e
            self._record(step, time.monotonic(), False, str(e))
        finally:
            self._server.release()

    def _server_fault(self, step: Step) -> str:
        name = step.fault
        if name == PART_WAY_FAULT:
            self.instruments.fault_file.write_text(PART_WAY_FAULT)
            try:
                time.sleep(FAIL_WINDOW_S)
            finally:
                self.instruments.fault_file.write_text("")
            return f"transfers failed part-way for {FAIL_WINDOW_S:g} s"
        action, role = name.split("-")
        leader = self.cluster.procs[role].pid
        if action == "stop":
            signal_group(leader, signal.SIGSTOP)
            try:
                time.sleep(step.stop_s)
            finally:
                signal_group(leader, signal.SIGCONT)
            return f"{role} stopped {step.stop_s:.1f} s ({step.stop_s / self.plan.release_timeout_s:.1f} release timeouts)"
        pids = group_pids(leader)
        signal_group(leader, signal.SIGKILL)
        killed_at = time.monotonic()
        self.killed.update({str(pid): killed_at for pid in pids})
        if role == "decode":
            self.decode_kills.append(killed_at)
        try:
            self.restart(role)
        except SandboxError as e:
            raise RestartFailed(f"{role} would not restart after its kill: {e}") from e
        return f"{role} killed and back after {time.monotonic() - killed_at:.0f} s"


def abort_request(url: str, rid: str) -> int:
    """``POST /abort_request`` for ``rid`` to the server at ``url``; its HTTP status (raises OSError)."""
    req = urllib.request.Request(f"{url}/abort_request", data=json.dumps({"rid": rid}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as reply:
        return reply.status


def _abort(url: str, rid: str) -> tuple[bool, str]:
    try:
        return True, f"HTTP {abort_request(url, rid)}"
    except OSError as e:
        return False, f"abort not delivered: {e}"

