"""Reads the page ledger the overlay's ``sgl_ledger`` writes and judges it.

The rules: a decode page exposed to a room's transfer must not go back to the
free list before every write of that room into it has returned (a write that
never returned may still land at any time); and a prefill page must not go
back to prefill's free list while a write is reading it.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import overlay_module

writer = overlay_module("sgl_ledger")  # the writer's own names: DIR_ENV, SLOW_ENV, SLOW_MIN_PAGES


@dataclass(frozen=True)
class Write:
    room: int
    pages: tuple[int, ...]
    begin: float
    end: float  # math.inf: never returned
    src: tuple[int, ...] = ()  # the prefill pages it reads
    pid: str = ""


@dataclass(frozen=True)
class UnsafeFree:
    """Decode freed ``page`` of ``room`` at ``freed_at`` while the room's write into it could land."""

    room: int
    page: int
    freed_at: float
    write_end: float

    def __str__(self) -> str:
        until = "never returned" if math.isinf(self.write_end) else f"returned {self.write_end - self.freed_at:.3f} s later"
        return f"room {self.room}: page {self.page} freed while its write was in flight (the write {until})"


def ledger_env(folder: Path, slow_s: float) -> tuple[str, str]:
    """The servers' environment entries that turn the ledger on into ``folder`` and slow each
    large write call by ``slow_s`` (so a fault can land while it is in flight)."""
    return f"{writer.DIR_ENV}={folder}", f"{writer.SLOW_ENV}={slow_s}"


def wait_for(folder: Path, ev: str, min_pages: int = 0, timeout_s: float = 60.0, after: float = 0.0) -> dict:
    """The first ``ev`` event over at least ``min_pages`` pages since ``after`` (time.monotonic(),
    the ledger's clock), once the ledger has one."""
    deadline = time.monotonic() + timeout_s
    while not (seen := [e for e in Ledger(folder).of(ev) if len(e.get("pages", ())) >= min_pages and e["t"] > after]):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {ev!r} event over {min_pages}+ pages in {timeout_s:.0f} s")
        time.sleep(0.05)
    return seen[0]


class Ledger:
    """All events of one cluster run, in time order."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.jsonl"))
        events = [dict(json.loads(line), pid=f.stem) for f in self.files for line in f.read_text().splitlines()]
        self.events = sorted(events, key=lambda e: e["t"])

    def of(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]

    def writes(self, killed_at: float = math.inf) -> list[Write]:
        """Each begin paired with the end of the same write in its process (its ``w``; an end with
        none, a fault stand-in's, ends the room's oldest open write); one that never ended ends at
        ``killed_at``, when its writer was killed (if it was)."""
        open_: dict[tuple[str, int], list[dict]] = defaultdict(list)
        done: list[Write] = []
        for e in self.events:
            key = (e["pid"], e.get("room"))
            if e["ev"] == "begin":
                open_[key].append(e)
            elif e["ev"] == "end" and (same := [b for b in open_[key] if e.get("w") in (None, b["w"])]):
                open_[key].remove(same[0])
                done.append(self._write(same[0], e["t"]))
        return done + [self._write(b, killed_at) for begins in open_.values() for b in begins]

    @staticmethod
    def _write(begin: dict, end: float) -> Write:
        return Write(begin["room"], tuple(begin["pages"]), begin["t"], end, tuple(begin.get("src", ())), begin["pid"])

    def unsafe_frees(self, killed_at: float = math.inf) -> list[UnsafeFree]:
        """Every page freed after its exposure to a room and before that room's write into it
        returned (or its writer was killed: see ``writes``)."""
        exposures: dict[int, list[tuple[float, int]]] = defaultdict(list)  # page -> [(t, room)]
        frees: dict[int, list[float]] = defaultdict(list)
        for e in self.events:
            if e["ev"] == "expose":
                for p in e["pages"]:
                    exposures[p].append((e["t"], e["room"]))
            elif e["ev"] == "free":
                for p in e["pages"]:
                    frees[p].append(e["t"])
        found = []
        for w in self.writes(killed_at):
            for p in w.pages:
                exposed_at = max((t for t, room in exposures[p] if room == w.room and t <= w.begin), default=None)
                if exposed_at is None:
                    continue  # not a page decode gave this room: not this oracle's question
                freed_at = min((t for t in frees[p] if t >= exposed_at), default=math.inf)
                if freed_at < w.end:
                    found.append(UnsafeFree(w.room, p, freed_at, w.end))
        return found

    def unsafe_source_frees(self) -> list[UnsafeFree]:
        """Every prefill page that went back to prefill's free list while a write was reading
        it (``page`` is the prefill page)."""
        frees = [(e["t"], e["pid"], p) for e in self.of("srcfree") for p in e["pages"]]
        return [UnsafeFree(w.room, p, t, w.end) for w in self.writes() for t, pid, p in frees
                if pid == w.pid and p in w.src and w.begin <= t < w.end]

    def write_end(self, room: int) -> float:
        """When the room's last write returned."""
        return max(w.end for w in self.writes() if w.room == room)

    def held_after_write_s(self, room: int) -> float:
        """Seconds from the room's last write returning to decode freeing its pages
        (negative: freed while the write was in flight)."""
        exposure = next(e for e in self.of("expose") if e["room"] == room)
        return min(e["t"] for e in self.of("free")
                   if set(exposure["pages"]) & set(e["pages"]) and e["t"] >= exposure["t"]) - self.write_end(room)
