"""Reading a JSON reply from a peer that any request may name: bounded, and failing only in
READ_ERRORS, which a seam's caller catches so that nothing a peer sends can stop a scheduler.

Bounded means: one deadline for the whole exchange (a socket's own timeout restarts at every
read, so a peer sending a byte at a time would hold the caller for ever), a byte limit on the
reply, and no redirect followed (nor a proxy from the environment used): the request, and the
token header a caller may put on it, go to the address named and nowhere else. Name resolution
is the one wait left to the resolver's own timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

# What a read can raise: refused or reset connections and timeouts (OSError, HTTPError
# among them: any status but 2xx, a redirect too), bad JSON, a reply over its limit or a URL
# that is not http to a host (ValueError), JSON nested past the stack (RecursionError), a
# broken HTTP exchange (HTTPException).
READ_ERRORS = (OSError, ValueError, RecursionError, http.client.HTTPException)


def get_json(request: str | urllib.request.Request, timeout_s: float, limit: int) -> object:
    """GET the peer's reply parsed as JSON, read up to ``limit`` bytes (ValueError past it),
    all of it within ``timeout_s`` (TimeoutError past it); a status other than 2xx raises
    urllib's HTTPError with that status, as urllib's own reader would."""
    deadline = time.monotonic() + timeout_s
    url, headers = (request, {}) if isinstance(request, str) else (request.full_url, dict(request.header_items()))
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http URL with a host: {url[:200]}")
    connection = http.client.HTTPConnection(parts.netloc)
    try:
        connection.sock = _DeadlineSocket.open((connection.host, connection.port), deadline)
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=headers)
        with connection.getresponse() as reply:
            if reply.status // 100 != 2:
                raise urllib.error.HTTPError(url, reply.status, reply.reason, reply.headers, None)
            body = reply.read(limit + 1)
    finally:
        connection.close()
    if len(body) > limit:
        raise ValueError(f"reply over {limit} bytes")
    return json.loads(body)


class _DeadlineSocket(socket.socket):
    """A connected socket whose every send and receive (http.client's reads all go through
    ``recv_into``) waits only for what is left until one deadline."""

    deadline = 0.0

    @classmethod
    def open(cls, address: tuple[str, int], deadline: float) -> _DeadlineSocket:
        sock = cls(fileno=socket.create_connection(address, _left(deadline)).detach())
        sock.deadline = deadline
        return sock

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data, flags: int = 0) -> None:
        self.settimeout(_left(self.deadline))
        super().sendall(data, flags)


def _left(deadline: float) -> float:
    """Seconds left until ``deadline``; TimeoutError (an OSError) once none are."""
    if (left := deadline - time.monotonic()) <= 0:
        raise TimeoutError("peer reply past its deadline")
    return left


def is_int(value: object) -> bool:
    """A JSON integer (Python's bool is an int; JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)
