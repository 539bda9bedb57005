"""How a hardened server reads a peer's JSON route (runtime/peer_json.py), against real loopback
peers that misbehave at the socket: one that redirects, one that trickles its reply."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from sglang_hardened.runtime import startup
from sglang_hardened.runtime.peer_json import READ_ERRORS, get_json

TOKEN = "decode-only-secret"
DEADLINE_S = 1.0
# The trickling peer sends a byte every TRICKLE_S, far inside DEADLINE_S, for as long as the
# test runs: only a deadline on the whole exchange ends the read. BOUND_S is 30 times the
# deadline, so a call that ends by it passes however loaded the machine; a per-read timeout
# never ends (the peer is cut off at teardown).
TRICKLE_S = 0.05
BOUND_S = 30.0
Handler = Callable[[socket.socket, threading.Event], None]  # one connection, and the test's end


@pytest.fixture
def peer() -> Iterator[Callable[[Handler], int]]:
    """Loopback TCP servers: each connection is handed to ``handle``; returns the port."""
    stop = threading.Event()
    listeners: list[socket.socket] = []

    def serve(handle: Handler) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=lambda: _run(handle, conn, stop), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return listener.getsockname()[1]

    yield serve
    stop.set()
    for listener in listeners:
        listener.close()


def _run(handle: Handler, conn: socket.socket, stop: threading.Event) -> None:
    with conn:
        try:
            handle(conn, stop)
        except OSError:  # the client hung up
            pass


def _request_head(conn: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
        head += chunk
    return head


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_token_goes_nowhere_else(status, peer):
    """Finding (review): urllib followed the redirect and sent the caller's headers, the bootstrap
    token among them, to whatever host the peer named."""
    elsewhere: list[bytes] = []

    def other_host(conn: socket.socket, _stop: threading.Event) -> None:
        elsewhere.append(_request_head(conn))
        conn.sendall(b'HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}')

    target = f"http://127.0.0.1:{peer(other_host)}/hardened/outcomes?after=-1"

    def redirecting(conn: socket.socket, _stop: threading.Event) -> None:
        _request_head(conn)
        conn.sendall(f"HTTP/1.1 {status} Moved\r\nlocation: {target}\r\ncontent-length: 0\r\n\r\n".encode())

    url = f"http://127.0.0.1:{peer(redirecting)}/hardened/outcomes?after=-1"
    with pytest.raises(urllib.error.HTTPError) as refused:
        get_json(urllib.request.Request(url, headers={"X-SGLang-Hardened-Token": TOKEN}), BOUND_S, 4096)
    assert refused.value.code == status
    assert elsewhere == [], "the request, and its token, reached the host the redirect named"


def test_a_redirecting_prefill_is_not_ready_and_its_status_logged(peer, monkeypatch, caplog):
    """The caller's side (H7's readiness check): the redirect is an unreadable reply."""

    def redirecting(conn: socket.socket, _stop: threading.Event) -> None:
        _request_head(conn)
        conn.sendall(b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:1/\r\ncontent-length: 0\r\n\r\n")

    addr = f"127.0.0.1:{peer(redirecting)}"
    monkeypatch.setattr(startup, "_own_input_limit", 1018)
    with caplog.at_level(logging.WARNING, logger="sglang_hardened"):
        assert startup.check_prefill_limits(addr) is False
    assert f"cannot read the input limit of the prefill at {addr} (HTTP 302)" in caplog.text


TRICKLES = {  # what the peer sends at once, then one byte of the endless rest every TRICKLE_S
    "in its headers": (b"HTTP/1.1 200 OK\r\n", b"x-slow: " + b"a" * 100_000),
    "in its body": (b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n", b" " * 100_000),  # JSON whitespace
}


@pytest.mark.parametrize("where", TRICKLES)
def test_a_peer_that_trickles_its_reply_is_cut_off_at_one_deadline(where, peer):
    """Finding (review): the timeout was per socket read, so a peer sending a byte at a time held
    the caller (decode's scheduler, for H7's check) for as long as it kept sending."""
    start, rest = TRICKLES[where]

    def trickling(conn: socket.socket, stop: threading.Event) -> None:
        _request_head(conn)
        conn.sendall(start)
        for i in range(len(rest)):
            if stop.wait(TRICKLE_S):
                return
            conn.sendall(rest[i:i + 1])

    url = f"http://127.0.0.1:{peer(trickling)}/hardened/limits"
    raised: list[BaseException] = []

    def read() -> None:
        try:
            get_json(url, DEADLINE_S, 4096)
        except READ_ERRORS as exc:
            raised.append(exc)

    began = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(BOUND_S)
    assert not reader.is_alive(), f"still reading {time.monotonic() - began:.0f} s into a {DEADLINE_S} s deadline"
    assert [type(e) for e in raised] == [TimeoutError]
