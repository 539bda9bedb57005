"""Reads the page ledger the overlay's ``sgl_ledger`` writes and judges it.

The rules: a decode page exposed to a room's transfer must not go back to the
free list before every write of that room into it has returned (a write that
never returned may still land at any time); a prefill page must not go
back to prefill's free list while a write is reading it; and each position of
a prompt decode attends to must come from a slot prefill holds for that request
(``unowned_reads``: a page is sent whole, so its slots past the request's end
carry whatever an earlier request left there).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .env import overlay_module

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
    write_begin: float = 0.0

    def __str__(self) -> str:
        until = "never returned" if math.isinf(self.write_end) else f"returned {self.write_end - self.freed_at:.3f} s later"
        return f"room {self.room}: page {self.page} freed while its write was in flight (the write {until})"


@dataclass(frozen=True)
class UnownedRead:
    """Decode's prompt position ``position`` of ``room`` comes from prefill slot ``slot``, which
    prefill did not hold for the room: its KV is ``owner``'s (the room that last held the slot;
    None: none did), or, with ``slot`` None, no write of the room covered its page."""

    room: int
    position: int
    slot: int | None
    owner: int | None


def ledger_env(folder: Path, slow_s: float) -> tuple[str, str]:
    """The servers' environment entries that turn the ledger on into ``folder`` and slow each
    large write call by ``slow_s`` (so a fault can land while it is in flight)."""
    return f"{writer.DIR_ENV}={folder}", f"{writer.SLOW_ENV}={slow_s}"


def wait_for(folder: Path, ev: str, min_pages: int = 0, timeout_s: float = 60.0, after: float = 0.0,
             room: int | None = None) -> dict:
    """The first ``ev`` event over at least ``min_pages`` pages since ``after`` (time.monotonic(),
    the ledger's clock), of ``room`` if given (one of several requests in flight), once the
    ledger has one."""
    deadline = time.monotonic() + timeout_s
    while not (seen := [e for e in Ledger(folder).of(ev) if len(e.get("pages", ())) >= min_pages and e["t"] > after
                        and room in (None, e.get("room"))]):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {ev!r} event over {min_pages}+ pages{f' of room {room}' if room else ''} "
                                 f"in {timeout_s:.0f} s")
        time.sleep(0.05)
    return seen[0]


class Ledger:
    """All events of one cluster run, in time order."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.jsonl"))
        events = [dict(json.loads(line), pid=f.stem) for f in self.files
                  for line in f.read_text().splitlines(keepends=True) if line.endswith("\n")]  # not one being written
        self.events = sorted(events, key=lambda e: e["t"])

    def of(self, ev: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == ev]

    def writes(self, killed_at: float = math.inf, killed: Mapping[str, float] | None = None) -> list[Write]:
        """Each begin paired with the end of the same write in its process (its ``w``; an end with
        none, a fault stand-in's, ends the room's oldest open write); one that never ended ends
        when its writer was killed: ``killed`` maps a writer's pid to that moment, ``killed_at``
        stands for any other (both: never, by default)."""
        killed = killed or {}
        open_: dict[tuple[str, int], list[dict]] = defaultdict(list)
        done: list[Write] = []
        for e in self.events:
            key = (e["pid"], e.get("room"))
            if e["ev"] == "begin":
                open_[key].append(e)
            elif e["ev"] == "end" and (same := [b for b in open_[key] if e.get("w") in (None, b["w"])]):
                open_[key].remove(same[0])
                done.append(self._write(same[0], e["t"]))
        return done + [self._write(b, killed.get(b["pid"], killed_at)) for begins in open_.values() for b in begins]

    @staticmethod
    def _write(begin: dict, end: float) -> Write:
        return Write(begin["room"], tuple(begin["pages"]), begin["t"], end, tuple(begin.get("src", ())), begin["pid"])

    def unsafe_frees(self, killed_at: float = math.inf, killed: Mapping[str, float] | None = None) -> list[UnsafeFree]:
        """Every page freed after its exposure to a room and before that room's write into it
        returned (or its writer was killed: see ``writes``). Only the exposing process's frees
        count: a decode restarted in its place has new memory under the same page numbers.
        Indexed by page, so a soak's hundred thousand events take seconds."""
        exposures: dict[tuple[int, int], list[tuple[float, str]]] = defaultdict(list)  # (page, room) -> [(t, pid)]
        frees = self._times("free")
        for e in self.of("expose"):
            for p in e["pages"]:
                exposures[(p, e["room"])].append((e["t"], e["pid"]))
        found = []
        for w in self.writes(killed_at, killed):
            for p in w.pages:
                exposed = max(((t, pid) for t, pid in exposures.get((p, w.room), ()) if t <= w.begin), default=None)
                if exposed is None:
                    continue  # not a page decode gave this room: not this oracle's question
                times = frees.get((exposed[1], p), [])
                at = bisect.bisect_left(times, exposed[0])
                freed_at = times[at] if at < len(times) else math.inf
                if freed_at < w.end:
                    found.append(UnsafeFree(w.room, p, freed_at, w.end, w.begin))
        return found

    def unsafe_source_frees(self, killed: Mapping[str, float] | None = None) -> list[UnsafeFree]:
        """Every prefill page that went back to prefill's free list while a write was reading
        it (``page`` is the prefill page)."""
        frees = self._times("srcfree")
        found = []
        for w in self.writes(killed=killed):
            for p in w.src:
                times = frees.get((w.pid, p), [])
                found += [UnsafeFree(w.room, p, t, w.end, w.begin)
                          for t in times[bisect.bisect_left(times, w.begin):bisect.bisect_left(times, w.end)]]
        return found

    def _times(self, ev: str) -> dict[tuple[str, int], list[float]]:
        """(process, page) -> when ``ev`` named the page, in time order."""
        times: dict[tuple[str, int], list[float]] = defaultdict(list)
        for e in self.of(ev):
            for p in e["pages"]:
                times[(e["pid"], p)].append(e["t"])
        return times

    def calls(self, room: int) -> list[dict]:
        """The Mooncake engine calls the room's writes made, in order (``call`` events)."""
        return [e for e in self.of("call") if e["room"] == room]

    def unowned_reads(self, room: int) -> list[UnownedRead]:
        """Each position of the room's prompt on decode (its last exposure's ``tokens``) whose KV
        is not prefill's for the room: the page was never written for it, or the slot the
        write carried there is one prefill held for no position of the room (``owns``)."""
        exposure = [e for e in self.of("expose") if e["room"] == room][-1]
        owns = [e for e in self.of("owns") if e["room"] == room]
        if not owns:
            raise AssertionError(f"room {room}: no `owns` record: prefill's ledger seam did not run")
        page_size = owns[-1]["page_size"]
        if len(exposure["pages"]) != -(-exposure["tokens"] // page_size):
            raise AssertionError(f"room {room}: decode exposed {len(exposure['pages'])} pages for "
                                 f"{exposure['tokens']} tokens: not a whole prompt from position 0")
        mine = {s for e in owns for s in e["slots"]}
        source = {dst: src for b in self.of("begin") if b["room"] == room and b["t"] > exposure["t"]
                  for dst, src in zip(b["pages"], b["src"])}
        last = owns[-1]  # whose KV a slot held when the room's last chunk went: its last holder before
        holder = {s: e["room"] for e in self.of("owns")
                  if e["pid"] == last["pid"] and e["t"] < last["t"] and e["room"] != room for s in e["slots"]}
        reads = []
        for position in range(exposure["tokens"]):
            page = source.get(exposure["pages"][position // page_size])
            slot = None if page is None else page * page_size + position % page_size
            if slot not in mine:
                reads.append(UnownedRead(room, position, slot, holder.get(slot)))
        return reads

    def write_end(self, room: int) -> float:
        """When the room's last write returned."""
        return max(w.end for w in self.writes() if w.room == room)

    def frees_of(self, room: int) -> list[dict]:
        """Decode's frees of pages it exposed to ``room``, after its last exposure, in order (none
        when it exposed none)."""
        exposures = [e for e in self.of("expose") if e["room"] == room]
        return [f for f in self.of("free") if exposures and f["t"] > exposures[-1]["t"]
                and set(f["pages"]) & set(exposures[-1]["pages"])]

    def held_after_write_s(self, room: int) -> float:
        """Seconds from the room's last write returning to decode freeing its pages
        (negative: freed while the write was in flight)."""
        exposure = next(e for e in self.of("expose") if e["room"] == room)
        return min(e["t"] for e in self.of("free")
                   if set(exposure["pages"]) & set(e["pages"]) and e["t"] >= exposure["t"]) - self.write_end(room)
