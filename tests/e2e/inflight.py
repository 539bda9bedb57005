"""One request caught mid-transfer: sent to both roles as a load balancer does, returned
once prefill's slowed write call into decode has begun (sglang_hardened/sandbox/ledger.py); and a
long request that keeps decode's loop in batches (a batch in flight beside what a test catches)."""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sglang_hardened.operations.oracle import Reply, generate
from sglang_hardened.sandbox.cluster import Cluster
from sglang_hardened.sandbox.ledger import Ledger, wait_for, writer
from sglang_hardened.sandbox.soak import faults

from .scenarios import FITTING_C, SLOW_PROMPT, TENANT_A, bootstrap_fields, post

BUSY_TOKENS = 800  # decoded one step per in-flight delay: longer than a case, which ends it


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (the connection broke or timed out)
    body: str
    seconds: float  # from the request being sent


@dataclass
class InFlight:
    room: int
    rid: str
    sent_at: float
    conns: dict[str, http.client.HTTPConnection]
    answers: dict[str, Answer] = field(default_factory=dict)

    def read_answers(self, timeout_s: float) -> None:
        """Read both roles' answers in the background (each socket waits ``timeout_s``)."""
        for role, conn in self.conns.items():
            conn.sock.settimeout(timeout_s)
            threading.Thread(target=self._read, args=(role, conn), daemon=True).start()

    def _read(self, role: str, conn: http.client.HTTPConnection) -> None:
        try:
            r = conn.getresponse()
            self.answers[role] = Answer(r.status, r.read().decode(errors="replace"), time.monotonic() - self.sent_at)
        except OSError as e:
            self.answers[role] = Answer(None, repr(e), time.monotonic() - self.sent_at)

    def answer(self, role: str, timeout_s: float = 120.0) -> Answer:
        deadline = time.monotonic() + timeout_s
        while role not in self.answers and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.answers.get(role) or Answer(None, f"no answer in {timeout_s:.0f} s", timeout_s)


def send_mid_transfer(cluster, folder: Path, rid: str, slow_switch: Path | None = None) -> InFlight:
    """Send SLOW_PROMPT to both roles; return once prefill's write into decode has begun.
    ``slow_switch``: the cluster's SANDBOX_SLOW_SWITCH file, on for this request only."""
    if slow_switch:
        slow_switch.touch()
    try:
        req = _send(cluster, rid, "prefill", "decode")
        req.room = wait_for(folder, "begin", writer.SLOW_MIN_PAGES, after=req.sent_at)["room"]
    finally:
        if slow_switch:
            slow_switch.unlink()
    return req


def send_all_mid_transfer(cluster, folder: Path, sends: list[tuple[str, str, str]],
                          slow_switch: Path) -> list[InFlight]:
    """Send SLOW_PROMPT once per (rid, prefill, decode) of a many-server cluster, all at once, as
    a balancer that chose those pairs; return once every one's slowed write has begun (their
    writes then run together, each on its own transfer queue)."""
    slow_switch.touch()
    try:
        reqs = [_send(cluster, rid, prefill, decode) for rid, prefill, decode in sends]
        for req in reqs:
            wait_for(folder, "begin", writer.SLOW_MIN_PAGES, after=req.sent_at, room=req.room)
    finally:
        slow_switch.unlink()
    return reqs


def _send(cluster, rid: str, prefill: str, decode: str) -> InFlight:
    """SLOW_PROMPT to ``prefill`` and ``decode`` (servers' names), answers left unread."""
    fields = bootstrap_fields(cluster, prefill)
    body = {"text": SLOW_PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}, "rid": rid, **fields}
    sent_at = time.monotonic()
    conns = {"prefill": post(cluster.procs[prefill].url, body), "decode": post(cluster.procs[decode].url, body)}
    return InFlight(fields["bootstrap_room"], rid, sent_at, conns)


def abort_request(cluster, role: str, rid: str) -> None:
    """``POST /abort_request`` for ``rid`` to one role."""
    faults.abort_request(cluster.procs[role].url, rid)


class Busy:
    """One long request through the load balancer, so decode's overlap loop runs a batch at every
    pass until ``end`` aborts it on both roles. ``idle``: the KV tokens decode holds idle (its
    growth past them shows decode runs the request)."""

    def __init__(self, cluster: Cluster, idle: int) -> None:
        self.cluster, self.rid, self.reply = cluster, uuid.uuid4().hex, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline, held = time.monotonic() + 60, []
        while len(set(held)) < 3 and time.monotonic() < deadline:  # until its KV grows: decode's batches run it
            if (used := cluster.used_tokens()["decode"]) > idle:
                held.append(used)
            time.sleep(0.2)
        assert len(set(held)) >= 3, f"decode never ran the busy request: {held}"

    def _run(self) -> None:
        self.reply: Reply = generate(self.cluster.lb_url, FITTING_C, BUSY_TOKENS, timeout=600,
                                     extra={"rid": self.rid, "sampling_params": {
                                         "temperature": 0.0, "max_new_tokens": BUSY_TOKENS, "ignore_eos": True}})

    def end(self) -> Reply:
        for role in ("decode", "prefill"):
            abort_request(self.cluster, role, self.rid)
        self.thread.join(60)
        return self.reply


def beside_busy(cluster: Cluster, probe: Callable[[str], Reply]) -> Callable[[str], Reply]:
    """A sender for the differential oracle (``observe_probes``): tenant A's history as it is, one
    token each (it only has to leave its KV in decode's pages); each probe sent by ``probe`` with a
    busy request decoding beside it, so decode checks, refuses and frees the probe's pages with a
    batch unfinished. Made while the cluster is idle."""
    idle = cluster.used_tokens()["decode"]

    def send(prompt: str) -> Reply:
        if prompt in TENANT_A.values():
            return cluster.generate(prompt, max_new_tokens=1)
        busy = Busy(cluster, idle)
        try:
            return probe(prompt)
        finally:
            busy.end()
    return send


def in_flight_at(ledger: Ledger, room: int) -> tuple[int, int]:
    """The batches unfinished on decode when it exposed the room's pages, and when it first freed them."""
    exposed = [e for e in ledger.of("expose") if e["room"] == room][-1]
    frees = ledger.frees_of(room)
    return exposed.get("in_flight", 0), frees[0].get("in_flight", 0) if frees else 0
