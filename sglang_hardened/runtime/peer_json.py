"""Reading a JSON reply from a peer that any request may name: bounded, and failing only in
READ_ERRORS, which a seam's caller catches so that nothing a peer sends can stop a scheduler."""

from __future__ import annotations

import http.client
import json
import urllib.request

# What a read can raise: refused or reset connections and timeouts (OSError, HTTPError
# among them), bad JSON or a reply over its limit (ValueError), JSON nested past the
# stack (RecursionError), a broken HTTP exchange (HTTPException).
READ_ERRORS = (OSError, ValueError, RecursionError, http.client.HTTPException)


def get_json(request: str | urllib.request.Request, timeout_s: float, limit: int) -> object:
    """The peer's reply parsed as JSON, read up to ``limit`` bytes (ValueError past it)."""
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        body = reply.read(limit + 1)
    if len(body) > limit:
        raise ValueError(f"reply over {limit} bytes")
    return json.loads(body)


def is_int(value: object) -> bool:
    """A JSON integer (Python's bool is an int; JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)
