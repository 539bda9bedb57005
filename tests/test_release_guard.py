"""H5's release guard: past the release timeout a held page goes back only once the
prefill that may write into it is gone, told apart from a stalled one by real sockets."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from sglang_hardened.runtime import release_guard
from sglang_hardened.runtime.release_guard import PeerWatch, refuses


def _closed_port() -> tuple[str, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    ep = s.getsockname()
    s.close()
    return ep


@pytest.fixture
def stopped_listener():
    """A process that listens and is then stopped (SIGSTOP), as a stalled prefill is."""
    proc = subprocess.Popen([sys.executable, "-c", "import socket,sys,time\ns=socket.socket();s.bind(('127.0.0.1',0));"
                             "s.listen(8);print(s.getsockname()[1],flush=True);time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    proc.send_signal(signal.SIGSTOP)
    yield ("127.0.0.1", port), proc
    proc.kill()
    proc.wait()


def _until(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_only_a_refused_connection_means_gone(stopped_listener):
    (ep, _), closed = stopped_listener, _closed_port()
    assert refuses(closed)
    assert not refuses(ep), "a stopped process's socket still accepts: it may resume and write"


def test_watch_says_gone_after_the_grace_and_not_before():
    closed = _closed_port()
    watch = PeerWatch(interval_s=0.05, grace_s=0.5)
    t0 = time.monotonic()
    assert not watch.gone([closed]), "not probed yet: not gone"
    assert _until(lambda: watch.gone([closed]))
    assert time.monotonic() - t0 >= 0.5


def test_a_process_that_dies_turns_gone_one_that_stays_stopped_never(stopped_listener):
    ep, proc = stopped_listener
    watch = PeerWatch(interval_s=0.05, grace_s=0.2)
    watch.gone([ep])
    assert not _until(lambda: watch.gone([ep]), timeout_s=1.5), "held while the process is stopped"
    proc.kill()
    proc.wait()
    assert _until(lambda: watch.gone([ep])), "released once it is gone"


def test_writers_gone_needs_every_rank_gone(stopped_listener, monkeypatch):
    """The seam reads a receiver's two attributes (stand-in: the CommonKVReceiver itself
    needs a whole KV manager; the e2e fault matrix runs the real one)."""
    monkeypatch.setattr(release_guard, "_watch", PeerWatch(interval_s=0.05, grace_s=0.2))
    (ip, port), _ = stopped_listener
    dead_ip, dead_port = _closed_port()
    both = SimpleNamespace(bootstrap_room=7, bootstrap_infos=[{"rank_ip": ip, "rank_port": port},
                                                              {"rank_ip": dead_ip, "rank_port": dead_port}])
    dead = SimpleNamespace(bootstrap_room=8, bootstrap_infos=[{"rank_ip": dead_ip, "rank_port": dead_port}])
    assert release_guard.writers_gone(SimpleNamespace(bootstrap_room=9, bootstrap_infos=None)), "no rank got pages"
    assert _until(lambda: release_guard.writers_gone(dead))
    assert not _until(lambda: release_guard.writers_gone(both), timeout_s=1.0)
