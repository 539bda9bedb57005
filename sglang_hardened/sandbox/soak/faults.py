"""Faults injected into a running sandbox, each from its own thread at its request's
chosen moment: aborts, stops, kills with a restart, transfers failing part-way, and rolling
restarts. A stop, a kill or a part-way failure hits one server of its role (the step's draw
names which) while the others serve; an abort goes to every server of its role (the one
serving the request ends it); a rolling restart replaces every server in turn.

Server faults run one at a time (a second one drawn meanwhile is skipped and counted):
two stops at once would measure the release timeout twice over, not a new failure.
While a fault waits to land, the cluster's write calls are slowed (the instruments'
switch), and a server fault waits for a write of its server to be in flight (the ledger
shows it begun and not ended: written by a prefill, or into a decode) before it lands, so
it hits a transfer as often as the traffic allows.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..cluster import RESTART_DEADLINE_S, Cluster, reap, signal_group
from ..env import SandboxError
from ..instruments import Instruments
from ..servers import ROLES
from .plan import SERVER_FAULTS, SoakPlan, Step

AIM_S = 3.0  # how long a server fault waits for a write in flight before it lands anyway
FAIL_WINDOW_S = 3.0  # how long transfers fail part-way
PART_WAY_FAULT = "fail-part-way"  # the overlay's fault name (tests/cpu_overlay/site/sgl_faults.py)
ROLLING = "rolling-restart"
TERM_GRACE_S = 15.0  # a rolled server's time to exit on SIGTERM before what is left is killed (a pod's grace, shortened)
KILL_WAIT_S = 5.0  # how long a killed server's processes may take to be gone


class RestartFailed(SandboxError):
    """A killed server did not come back: the soak cannot go on, and its cluster is half gone."""


@dataclass(frozen=True)
class FaultEvent:
    name: str
    at: float  # time.monotonic() when it landed (or was skipped)
    seconds: float  # how long it was in effect
    landed: bool
    note: str
    targets: tuple[str, ...] = ()  # the servers it hit, by name


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
    """The ledger read as it grows: which writes have begun and not ended, and which decode
    process took each room's pages (its ``expose``)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.offsets = folder, {}
        self.open: dict[tuple[str, int], int] = {}  # (writer pid, write) -> room
        self.exposer: dict[int, str] = {}  # room -> the decode process its pages are in

    def any(self, killed: Mapping[str, float], within: set[str] | None = None) -> bool:
        """Whether a write is in flight (by or into one of the processes ``within``, if given);
        those of a killed writer (its pid) ended at its kill."""
        for f in self.folder.glob("*.jsonl"):
            with f.open() as lines:
                lines.seek(self.offsets.get(f, 0))
                for line in iter(lines.readline, ""):
                    if not line.endswith("\n"):
                        break  # a line still being written: read it next time
                    self.offsets[f] = lines.tell()
                    e = json.loads(line)
                    if e["ev"] == "begin":
                        self.open[(f.stem, e["w"])] = e["room"]
                    elif e["ev"] == "end":
                        self.open.pop((f.stem, e["w"]), None) if "w" in e else self._end_oldest(f.stem)
                    elif e["ev"] == "expose":
                        self.exposer[e["room"]] = f.stem
        self.open = {(pid, w): room for (pid, w), room in self.open.items() if pid not in killed}
        return any(within is None or pid in within or self.exposer.get(room) in within
                   for (pid, _), room in self.open.items())

    def _end_oldest(self, pid: str) -> None:
        mine = sorted(w for p, w in self.open if p == pid)
        if mine:
            del self.open[(pid, mine[0])]


class Injector:
    """Lands each step's fault; remembers what landed, when, on which servers, and which
    writers it killed."""

    def __init__(self, cluster: Cluster, plan: SoakPlan, restart: Callable[[str], None],
                 instruments: Instruments | None) -> None:
        if instruments is None:
            raise SandboxError("the soak needs an instrumented cluster (`sandbox up ... --instrument`): "
                               "the page ledger judges it and the fault hooks inject its transfer faults")
        self.cluster, self.plan, self.restart = cluster, plan, restart
        self.instruments = instruments
        self.events: list[FaultEvent] = []
        self.windows: list[list[float]] = []  # [from, to] a server fault was in effect (to: inf while it is)
        self.killed: dict[str, float] = {}  # a killed server's pid (the ledger's file name) -> when it was gone
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
        for name in self.servers():
            signal_group(self.cluster.procs[name].pid, signal.SIGCONT)

    @property
    def longest_s(self) -> float:
        """The longest a server fault may still run once it has landed: a roll restarts every
        server in turn, a kill one."""
        rolls = self.plan.rates.get(ROLLING, 0) > 0
        return (len(self.servers()) if rolls else 1) * (TERM_GRACE_S + KILL_WAIT_S + RESTART_DEADLINE_S)

    def servers(self) -> list[str]:
        """Every server of the cluster, prefills first."""
        return [name for role in ROLES for name in self.cluster.servers(role)]

    def targets(self, step: Step) -> list[str]:
        """The servers ``step``'s fault hits: one of its role's, drawn; every one of its role for
        an abort (only the one serving the request has it); every server for a rolling restart."""
        if step.fault == ROLLING:
            return self.servers()
        role = "prefill" if step.fault == PART_WAY_FAULT else step.fault.split("-")[1]
        names = self.cluster.servers(role)
        return names if step.fault.startswith("abort-") else [names[step.target % len(names)]]

    def _record(self, step: Step, at: float, landed: bool, note: str, targets: list[str]) -> None:
        with self._lock:
            self.events.append(FaultEvent(step.fault, at, time.monotonic() - at, landed, note, tuple(targets)))

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
        targets = self.targets(step)
        if step.fault not in SERVER_FAULTS:
            with self._slowed():
                time.sleep(step.fault_after_s)
                at = time.monotonic()
                self._record(step, at, *_abort({n: self.cluster.procs[n].url for n in targets}, rid), targets)
            return
        if not self._server.acquire(blocking=False):
            self._record(step, time.monotonic(), False, "skipped: another server fault was in effect", targets)
            return
        try:
            with self._slowed():  # only until it lands: a write already slowed stays so
                time.sleep(step.fault_after_s)
                aim_until = time.monotonic() + AIM_S
                within = None if step.fault == ROLLING else self._pids(targets)
                while not self._writes.any(self.killed, within) and time.monotonic() < aim_until:
                    time.sleep(0.1)
            at = time.monotonic()
            window = [at, math.inf]
            self.windows.append(window)
            try:
                note = self._server_fault(step, targets)
            finally:
                window[1] = time.monotonic()
            self._record(step, at, True, note, targets)
        except RestartFailed as e:
            self.error = e
            self._record(step, time.monotonic(), False, str(e), targets)
        finally:
            self._server.release()

    def _pids(self, names: list[str]) -> set[str]:
        return {str(pid) for name in names for pid in group_pids(self.cluster.procs[name].pid)}

    def _server_fault(self, step: Step, targets: list[str]) -> str:
        name, target = step.fault, targets[0]
        if name == ROLLING:
            took = [f"{n} {self._replace(n, graceful=True):.0f} s" for n in targets]
            return f"every server stopped with SIGTERM and back in turn: {', '.join(took)}"
        if name == PART_WAY_FAULT:
            self.instruments.fault_file.write_text(f"{PART_WAY_FAULT}#{self.cluster.procs[target].pid}")
            try:
                time.sleep(FAIL_WINDOW_S)
            finally:
                self.instruments.fault_file.write_text("")
            return f"{target}'s transfers failed part-way for {FAIL_WINDOW_S:g} s"
        if name.startswith("stop-"):
            leader = self.cluster.procs[target].pid
            signal_group(leader, signal.SIGSTOP)
            try:
                time.sleep(step.stop_s)
            finally:
                signal_group(leader, signal.SIGCONT)
            return f"{target} stopped {step.stop_s:.1f} s ({step.stop_s / self.plan.release_timeout_s:.1f} release timeouts)"
        return f"{target} killed and back after {self._replace(target, graceful=False):.0f} s"

    def _replace(self, name: str, graceful: bool) -> float:
        """Kill server ``name`` (after a SIGTERM to its first process and TERM_GRACE_S to end, as
        Kubernetes stops a pod, if ``graceful``) and start it again; the seconds until it was
        healthy. Its processes' writes end when they are gone."""
        leader = self.cluster.procs[name].pid
        pids = group_pids(leader)
        began = time.monotonic()
        if graceful:
            signal_group(leader, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            try:
                os.kill(leader, signal.SIGTERM)
            except ProcessLookupError:
                pass
            _wait_gone(leader, began + TERM_GRACE_S)
        signal_group(leader, signal.SIGKILL)
        _wait_gone(leader, time.monotonic() + KILL_WAIT_S)
        self.killed.update({str(pid): time.monotonic() for pid in pids})
        try:
            self.restart(name)
        except SandboxError as e:
            raise RestartFailed(f"{name} would not restart after its {'SIGTERM' if graceful else 'kill'}: {e}") from e
        return time.monotonic() - began


def _wait_gone(leader: int, deadline: float) -> None:
    """Until no process of ``leader``'s group is left, or ``deadline``."""
    while time.monotonic() < deadline:
        reap(leader)  # a server this process started stays a zombie of its group until reaped
        if not group_pids(leader):
            return
        time.sleep(0.2)


def abort_request(url: str, rid: str) -> int:
    """``POST /abort_request`` for ``rid`` to the server at ``url``; its HTTP status (raises OSError)."""
    req = urllib.request.Request(f"{url}/abort_request", data=json.dumps({"rid": rid}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as reply:
        return reply.status


def _abort(urls: Mapping[str, str], rid: str) -> tuple[bool, str]:
    """``rid``'s abort to each server of ``urls`` (name -> URL): whether one at least took it,
    and what each said."""
    said, took = [], False
    for name, url in urls.items():
        try:
            said.append(f"{name} HTTP {abort_request(url, rid)}")
            took = True
        except OSError as e:
            said.append(f"{name} not delivered: {e}")
    return took, "; ".join(said)

