"""One request caught mid-transfer: sent to both roles as a load balancer does, returned
once prefill's slowed write call into decode has begun (sglang_hardened/sandbox/ledger.py)."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_hardened.sandbox.ledger import wait_for, writer
from sglang_hardened.sandbox.soak import faults

from .scenarios import SLOW_PROMPT, bootstrap_fields, post


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
