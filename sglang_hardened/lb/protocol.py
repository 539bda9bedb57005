"""What the LB checks in a client request and what it adds before forwarding.

A request that fails these checks gets a 4xx from the LB and never reaches a
worker. The LB always sets ``rid`` and the bootstrap fields itself: a
client-chosen bootstrap address or room could point decode at another
tenant's transfer, and the LB aborts by ``rid``, which the scheduler
matches as a prefix: a client-chosen rid could abort other tenants' requests.

A body is parsed and serialised once (``read_body``; in a worker process when large, see
``offload``); the lb's fields follow those bytes, never serialised with them.
Nothing here imports aiohttp, so a worker process starts light.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    from .workers import Worker

# route -> the fields of which the body needs at least one
ROUTES: dict[str, tuple[str, ...]] = {
    "generate": ("text", "input_ids", "input_embeds"),
    "v1/completions": ("prompt",),
    "v1/chat/completions": ("messages",),
}


# what the lb sets in every forwarded body, whatever the client sent
LB_FIELDS = frozenset({"rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"})


class BadRequest(Exception):
    """The client's request is malformed; the message says how."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)  # both in args: it comes back from a worker process pickled
        self.status, self.message = status, message

    def __str__(self) -> str:
        return self.message


def _no_constant(name: str) -> None:
    raise BadRequest(400, f"body is not valid JSON: {name} is not a JSON number")


def parse_body(route: str, raw: bytes) -> dict:
    """The JSON object of a request to ``route``, or BadRequest (Python's json would
    take NaN and Infinity, which JSON has not, and recurse out of the stack on deep nesting)."""
    try:
        payload = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadRequest(400, "body must be a JSON object")
    needed = ROUTES[route]
    if all(payload.get(f) is None for f in needed):
        raise BadRequest(400, f"/{route} needs one of: {', '.join(needed)}")
    return payload


def batch_size(route: str, payload: dict) -> int | None:
    """Items in a /generate batch (mini-lb's rule), None for a single request."""
    if route != "generate":
        return None
    if isinstance(text := payload.get("text"), list):
        return len(text)
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


@dataclass(frozen=True)
class ClientBody:
    """What the lb takes from a client's body, read once."""

    head: bytes  # the client's JSON object without the lb's fields, open: no closing brace
    batch: int | None  # items in a /generate batch, None for a single request
    stream: bool
    return_logprob: bool
    payload: dict  # the parsed body, for a routing policy that reads it; else empty


def read_body(route: str, raw: bytes, keep_payload: bool) -> ClientBody:
    """Check a body and serialise it once without the lb's fields (BadRequest if it fails)."""
    payload = parse_body(route, raw)
    head = json.dumps({k: v for k, v in payload.items() if k not in LB_FIELDS})[:-1].encode()
    return ClientBody(head, batch_size(route, payload), bool(payload.get("stream")),
                      bool(payload.get("return_logprob")), payload if keep_payload else {})


@dataclass(frozen=True)
class Forwarded:
    """The body both workers get (its parts in order: no copy of the client's), the rids that
    abort it (and nothing else), and how to read the answers: a stream, or whole answers whose
    logprobs are merged."""

    parts: tuple[bytes, ...]
    rids: tuple[str, ...]
    stream: bool
    merge: bool

    @property
    def size(self) -> int:
        return sum(map(len, self.parts))


def bootstrap_host(url: str) -> str:
    host = urlparse(url).hostname or ""
    try:
        ipaddress.IPv6Address(host)
        return f"[{host}]"
    except ValueError:
        return host


def forwarded(client: ClientBody, prefill: Worker) -> Forwarded:
    rid = f"lb-{uuid.uuid4().hex}"
    n = client.batch
    host = bootstrap_host(prefill.url)
    # Rooms from the OS's generator: `random`'s state can be recovered from its outputs, and a
    # known room lets anyone on the bootstrap port speak for another tenant's transfer.
    if n is None:
        rids: tuple[str, ...] = (rid,)
        fields = {"rid": rid, "bootstrap_host": host, "bootstrap_port": prefill.bootstrap_port,
                  "bootstrap_room": secrets.randbits(63)}
    else:
        # one width for a batch's indices: SGLang aborts by rid prefix, and lb-X-1 prefixes lb-X-10
        rids = tuple(f"{rid}-{i:0{len(str(n - 1))}d}" for i in range(n))
        fields = {"rid": list(rids), "bootstrap_host": [host] * n, "bootstrap_port": [prefill.bootstrap_port] * n,
                  "bootstrap_room": [secrets.randbits(63) for _ in range(n)]}
    tail = b", " + json.dumps(fields).encode()[1:]  # {"rid": …}: its fields close the client's object
    return Forwarded((client.head, tail), rids, client.stream, client.return_logprob and not client.stream)


def merge_logprobs(prefill: bytes, decode: bytes) -> bytes | None:
    """Decode's answer with prefill's prompt logprobs before its own (as mini-lb); None where
    either answer has none."""
    try:
        pre, dec = json.loads(prefill), json.loads(decode)
        dec["meta_info"]["input_token_logprobs"] = (pre["meta_info"]["input_token_logprobs"]
                                                    + dec["meta_info"]["input_token_logprobs"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return json.dumps(dec).encode()
