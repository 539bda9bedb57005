"""H5's release guard: past the release timeout a held page goes back only once the
prefill that may write into it is gone or demonstrably running, told apart from a
stalled one by real sockets and real processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import types
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import nixl_drain, release_guard
from sglang_hardened.runtime.release_guard import GONE, RUNNING, SILENT, PeerWatch, probe
from tests.harness import eventually

# A prefill rank's endpoint is a ZMQ socket, whose I/O thread greets each new connection
# with the ZMTP signature. Stand-in (pyzmq is not in the tool's environment): a process
# that sends those 10 bytes on accept; the e2e fault matrix probes real ZMQ sockets.
LISTENER = """
import socket, sys, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
held = []
while True:
    c, _ = s.accept(); held.append(c)
    if sys.argv[1] == "greet":
        c.sendall(b"\\xff" + bytes(8) + b"\\x7f")
"""


def _closed_port() -> tuple[str, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    ep = s.getsockname()
    s.close()
    return ep


@pytest.fixture
def listener():
    """Start a listening process (greeting or mute); yields a factory -> (endpoint, process)."""
    procs = []

    def start(greet: bool = True):
        proc = subprocess.Popen([sys.executable, "-c", LISTENER, "greet" if greet else "mute"],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return ("127.0.0.1", int(proc.stdout.readline())), proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_probe_tells_gone_running_and_stalled_apart(listener):
    (greets, _), (mute, _), (stopped, proc) = listener(), listener(greet=False), listener()
    proc.send_signal(signal.SIGSTOP)
    assert probe(_closed_port()) == GONE
    # the greeting takes the listener being scheduled: the 1 s default is tight on a loaded host
    assert probe(greets, timeout_s=30) == RUNNING
    assert probe(mute, timeout_s=0.3) == SILENT
    assert probe(stopped, timeout_s=0.3) == SILENT, "a stopped process's kernel accepts, but nothing greets"


def test_gone_after_the_grace_running_after_its_window_and_not_before(listener):
    closed, (greets, _) = _closed_port(), listener()
    watch = PeerWatch(interval_s=0.05, grace_s=0.3)
    t0 = time.monotonic()
    assert not watch.settled([closed, greets], running_for_s=1.0), "not probed yet: neither"
    assert eventually(lambda: watch.settled([closed, greets], running_for_s=1.0))
    assert time.monotonic() - t0 >= 1.0


def test_a_stopped_prefill_holds_until_it_runs_again_or_dies(listener):
    (ep, proc) = listener()
    proc.send_signal(signal.SIGSTOP)
    watch = PeerWatch(interval_s=0.05, grace_s=0.2)
    assert not eventually(lambda: watch.settled([ep], running_for_s=0.5), timeout_s=2.0), "held while stopped"
    proc.send_signal(signal.SIGCONT)
    assert eventually(lambda: watch.settled([ep], running_for_s=0.5)), "released once it has run a while"
    proc.send_signal(signal.SIGSTOP)
    assert eventually(lambda: not watch.settled([ep], running_for_s=0.5)), "stopped again: held again"
    proc.kill()
    proc.wait()
    assert eventually(lambda: watch.settled([ep], running_for_s=0.5)), "released once it is gone"


def test_writers_settled_needs_every_rank_settled(listener, monkeypatch):
    """The seam reads a receiver's two attributes (stand-in: the CommonKVReceiver itself
    needs a whole KV manager; the e2e fault matrix runs the real one)."""
    monkeypatch.setattr(release_guard, "_watch", PeerWatch(interval_s=0.05, grace_s=0.2))
    monkeypatch.setattr(release_guard, "process_release_timeout_s", lambda: 0.5)
    (ip, port), proc = listener()
    proc.send_signal(signal.SIGSTOP)
    dead_ip, dead_port = _closed_port()
    both = SimpleNamespace(bootstrap_room=7, bootstrap_infos=[{"rank_ip": ip, "rank_port": port},
                                                              {"rank_ip": dead_ip, "rank_port": dead_port}])
    dead = SimpleNamespace(bootstrap_room=8, bootstrap_infos=[{"rank_ip": dead_ip, "rank_port": dead_port}])
    assert release_guard.writers_settled(SimpleNamespace(bootstrap_room=9, bootstrap_infos=None)), "no rank got pages"
    assert eventually(lambda: release_guard.writers_settled(dead))
    assert not eventually(lambda: release_guard.writers_settled(both), timeout_s=1.5)


def _receiver(monkeypatch, module: str, drains: bool, room: int, endpoint: tuple[str, int]):
    """A receiver whose backend module (stand-in: the real ones need a whole SGLang) imports
    `nixl_drain` as 0023 makes NIXL's do, or not."""
    backend = types.ModuleType(module)
    if drains:
        backend.hardened_nixl_drain = nixl_drain
    monkeypatch.setitem(sys.modules, module, backend)
    receiver = type("KVReceiver", (), {"__module__": module})()
    receiver.bootstrap_room, receiver.bootstrap_infos = room, [{"rank_ip": endpoint[0], "rank_port": endpoint[1]}]
    return receiver


def test_a_nixl_hold_with_the_drain_ends_only_at_the_ack_or_a_gone_prefill(listener, monkeypatch):
    """A prefill running for a release timeout proves a Mooncake write done (H6 bounds it), not
    a NIXL one; a NIXL build whose prefill never acks such a room keeps the running rule."""
    monkeypatch.setattr(release_guard, "_watch", PeerWatch(interval_s=0.05, grace_s=0.2))
    monkeypatch.setattr(release_guard, "process_release_timeout_s", lambda: 0.3)
    endpoint, _ = listener()
    mooncake = _receiver(monkeypatch, "sgl_test.mooncake.conn", False, 1, endpoint)
    old_nixl = _receiver(monkeypatch, "sgl_test.old_nixl.conn", False, 2, endpoint)
    nixl = _receiver(monkeypatch, "sgl_test.nixl.conn", True, 3, endpoint)
    assert eventually(lambda: release_guard.writers_settled(mooncake))
    assert eventually(lambda: release_guard.writers_settled(old_nixl))
    assert not eventually(lambda: release_guard.writers_settled(nixl), timeout_s=1.5)


def test_a_hold_its_ack_ended_is_forgotten(monkeypatch):
    """A room logged as held past its timeout stayed in the guard's memory for ever when the
    drain ack, not the guard, ended the hold (the seam is then never asked about it again):
    one entry per such room, for the server's life. A room the seam stopped asking about is
    forgotten once ``FORGET_S`` has passed."""
    clock = [1000.0]
    monkeypatch.setattr(release_guard, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=time.sleep))
    monkeypatch.setattr(release_guard, "_watch", SimpleNamespace(settled=lambda endpoints, running_for_s: False))
    monkeypatch.setattr(release_guard, "process_release_timeout_s", lambda: 30.0)
    monkeypatch.setattr(release_guard, "_held", type(release_guard._held)())
    stalled = [{"rank_ip": "127.0.0.1", "rank_port": 1}]
    for room in range(100):  # held past the timeout, then acked: never asked about again
        assert not release_guard.writers_settled(SimpleNamespace(bootstrap_room=room, bootstrap_infos=stalled))
    clock[0] += 120.0
    assert not release_guard.writers_settled(SimpleNamespace(bootstrap_room=100, bootstrap_infos=stalled))
    assert len(release_guard._held) == 1
