"""Real Mooncake over TCP between two processes on 127.0.0.1, one batch write per case.

H6's test and benchmark need Mooncake's own per-call behaviour (the TCP
per-call entry limit, call times), not SGLang's, so this drives the engine
directly: a target process registers a buffer, this process writes entries
into it with ``batch_transfer_sync_write``, unbounded (one call) or through
``transfer_bounds``' seam (bounded calls), and checks the bytes that arrived.
A case may write from several threads at once, as SGLang's per-layer path
writes every layer. Each case gets a fresh engine pair: after a rejected
call Mooncake fails later calls to that peer. Runs inside a sandbox
environment (it has Mooncake): ``python -m sglang_hardened.sandbox.mooncake_pair
CASES_JSON``, or ``run``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .env import SandboxEnv


@dataclass(frozen=True)
class Case:
    """One write of ``entries`` entries of ``entry_bytes`` each, in ``threads`` equal parts written
    at once; ``bounds`` (max entries, max bytes) sends each part through transfer_bounds (the
    parts sharing one ``InFlight``), None sends each part as one call."""

    entries: int
    entry_bytes: int
    bounds: tuple[int, int] | None = None
    threads: int = 1


@dataclass
class Outcome:
    rc: int  # the first non-zero return of any part, else 0
    seconds: float  # the whole write, all calls
    call_seconds: list[float] = field(default_factory=list)
    call_entries: list[int] = field(default_factory=list)
    arrived: bool = False  # the target holds exactly the bytes sent


def _engine():
    os.environ["MC_FORCE_TCP"] = "1"
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake engine did not initialize")
    return engine


def _target(size: int, conn) -> None:
    """Child: register a buffer, say where it is, answer digest requests until told to stop."""
    engine = _engine()
    buf = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buf)
    if engine.register_memory(addr, size) != 0:
        raise RuntimeError("target buffer registration failed")
    conn.send((engine.get_rpc_port(), addr))
    while (length := conn.recv()) is not None:
        conn.send(hashlib.sha256(ctypes.string_at(addr, length)).hexdigest())


def run_case(case: Case) -> Outcome:
    """One case on a fresh engine pair."""
    from ..runtime.transfer_bounds import Bounds, InFlight, batch_transfer_sync

    size = case.entries * case.entry_bytes
    ctx = mp.get_context("spawn")  # the child must not inherit an initialized engine
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_target, args=(size, child_conn), daemon=True)
    child.start()
    try:
        port, remote = conn.recv()
        engine = _engine()
        payload = os.urandom(size)
        buf = ctypes.create_string_buffer(payload, size)
        local = ctypes.addressof(buf)
        engine.register_memory(local, size)
        outcome = Outcome(rc=0, seconds=0.0)

        def call(peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
            t = time.perf_counter()
            rc = engine.batch_transfer_sync_write(peer, srcs, dsts, lengths)
            outcome.call_seconds.append(time.perf_counter() - t)
            outcome.call_entries.append(len(srcs))
            return rc

        in_flight = InFlight()
        per_part = -(-case.entries // case.threads)
        returns: list[int] = []

        def write_part(first: int) -> None:
            offsets = [i * case.entry_bytes for i in range(first, min(first + per_part, case.entries))]
            part = ([local + o for o in offsets], [remote + o for o in offsets], [case.entry_bytes] * len(offsets))
            peer = f"127.0.0.1:{port}"
            returns.append(call(peer, *part) if case.bounds is None else
                           batch_transfer_sync(call, peer, *part, bounds=Bounds(*case.bounds), in_flight=in_flight))

        writers = [threading.Thread(target=write_part, args=(first,)) for first in range(0, case.entries, per_part)]
        start = time.perf_counter()
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        outcome.seconds = time.perf_counter() - start
        outcome.rc = next((rc for rc in returns if rc != 0), 0)
        conn.send(size)
        outcome.arrived = outcome.rc == 0 and conn.recv() == hashlib.sha256(payload).hexdigest()
        conn.send(None)
        return outcome
    finally:
        child.kill()
        child.join()


def run(env: SandboxEnv, cases: list[Case], timeout_s: float = 600) -> tuple[list[Outcome], str]:
    """Run ``cases`` in ``env``'s interpreter; the outcomes and Mooncake's log (stderr)."""
    run_env = env.environ()
    run_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), run_env["PYTHONPATH"]])
    done = subprocess.run([str(env.python), "-m", "sglang_hardened.sandbox.mooncake_pair",
                           json.dumps([asdict(c) for c in cases])],
                          env=run_env, capture_output=True, text=True, timeout=timeout_s, cwd="/")
    if done.returncode:
        from .env import SandboxError

        raise SandboxError(f"mooncake pair failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    return [Outcome(**o) for o in json.loads(done.stdout.splitlines()[-1])], done.stderr


if __name__ == "__main__":
    cases = [Case(**{**c, "bounds": tuple(c["bounds"]) if c["bounds"] else None}) for c in json.loads(sys.argv[1])]
    print(json.dumps([asdict(run_case(c)) for c in cases]))
