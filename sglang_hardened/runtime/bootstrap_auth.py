"""H14: prefill's bootstrap server takes registrations only from its own ranks.

Upstream's bootstrap server (in prefill rank 0's process) keeps the table decode reads to
find each prefill rank's transfer address, and fills it from `PUT /route`, answering 200 to
anyone who reaches the port: one well-formed request replaces a rank's address, so every
decode that bootstraps afterwards sends its requests, and takes its KV, from wherever the
sender pointed (a dead port is a total outage; a server of the sender's own reads other
tenants' prompts). `POST /register_dp_rank` likewise steers a room to any DP group. Here:

- with BOOTSTRAP_TOKEN.name set on prefill (the same secret decode sends to H4's outcome route), both
  writes need TOKEN_HEADER to match; others get 403, logged once per peer address, and the
  table is untouched (`guard`, a middleware the bootstrap server installs at its seam);
- a rank's registration, once made, is replaced only from the address that made it (409
  for any other), token or not: a rank that restarts registers again from the same host;
- a registration whose body is not a JSON object of integer ranks gets 400 naming what is
  wrong (upstream answers 500 from a KeyError);
- hardened ranks send the token with their writes (`headers`, a seam at each call).

Reads (`GET /route`, `/query_dp_ranks`) stay open: they reveal the ranks' addresses, which
the recipe's NetworkPolicy gives only to the servers; docs/security.md says why.
"""

from __future__ import annotations

import hmac
import json
import logging

from ..common.knobs import BOOTSTRAP_TOKEN

TOKEN_HEADER = "X-SGLang-Hardened-Token"
WRITES = frozenset({("PUT", "/route"), ("POST", "/register_dp_rank")})
RANKS_MAX = 16384  # rank keys one bootstrap server remembers (DP x CP x TP x PP of one prefill)
PEERS_LOGGED_MAX = 256  # refused peers logged by address; later ones are counted, not named

log = logging.getLogger("sglang_hardened")


def token_set() -> bool:
    """Whether this process holds a bootstrap token (what /server_info reports)."""
    return bool(BOOTSTRAP_TOKEN.get())


def headers() -> dict[str, str]:
    """What a hardened peer sends with its writes to, and reads from, a bootstrap server."""
    token = BOOTSTRAP_TOKEN.get()
    return {TOKEN_HEADER: token} if token else {}


def token_ok(request_headers) -> bool:
    """True when no token is set here, or the request carries the same one."""
    token = BOOTSTRAP_TOKEN.get()
    return not token or hmac.compare_digest(request_headers.get(TOKEN_HEADER, "").encode(), token.encode())


def refused_text(what: str) -> str:
    """The 403 body: names the header and the setting, never the value."""
    return f"{what} needs the {TOKEN_HEADER} header set to prefill's {BOOTSTRAP_TOKEN.name}"


def rank_key(data: object) -> tuple[tuple[str, int], ...]:
    """A registration's identity: every `*_rank` field, whatever the base calls its groups.
    ValueError names what is wrong with a body that is not one."""
    if not isinstance(data, dict):
        raise ValueError("a registration is a JSON object")
    key = tuple(sorted((k, v) for k, v in data.items() if k.endswith("_rank")))
    if not key:
        raise ValueError("a registration names its ranks (*_rank fields)")
    if bad := [k for k, v in key if type(v) is not int or v < 0]:
        raise ValueError(f"ranks must be non-negative integers: {', '.join(bad)}")
    return key


class Registrants:
    """Which peer address registered each rank key, and which refused peers were logged."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[tuple[str, int], ...], str] = {}
        self.logged: set[str] = set()

    def claim(self, key: tuple[tuple[str, int], ...], peer: str) -> str | None:
        """Claim ``key`` for ``peer``; the reason it is refused, or None."""
        owner = self.by_key.get(key)
        if owner is not None and owner != peer:
            return f"this rank registered from {owner}; another peer cannot replace it"
        if owner is None and len(self.by_key) >= RANKS_MAX:
            return f"more than {RANKS_MAX} ranks registered"
        self.by_key[key] = peer
        return None

    def say_once(self, peer: str, reason: str) -> None:
        if peer in self.logged or len(self.logged) >= PEERS_LOGGED_MAX:
            return
        self.logged.add(peer)
        log.warning("sglang-hardened H14: refused a bootstrap registration from %s: %s "
                    "(logged once per peer)", peer, reason)


def guard(app) -> None:
    """Seam where the bootstrap server sets up its routes: check every write before
    upstream's handler sees it (an aiohttp middleware, so upstream's handlers stay as they are)."""
    from aiohttp import web

    registrants = Registrants()

    def refuse(request: web.Request, status: int, reason: str) -> web.Response:
        registrants.say_once(request.remote or "unknown", reason)
        return web.Response(status=status, text=reason)

    @web.middleware
    async def check(request: web.Request, handler):
        if (request.method, request.path) not in WRITES:
            return await handler(request)
        if not token_ok(request.headers):
            return refuse(request, 403, refused_text(f"{request.method} {request.path}"))
        if request.method != "PUT":
            return await handler(request)
        try:
            key = rank_key(json.loads(await request.read()))
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            return refuse(request, 400, f"bad registration: {exc}")
        peer = request.remote or "unknown"
        known = key in registrants.by_key
        if reason := registrants.claim(key, peer):
            return refuse(request, 409, reason)
        taken = False
        try:  # upstream's handler reads the body again (aiohttp keeps it)
            response = await handler(request)
            taken = response.status == 200
            return response
        except (KeyError, TypeError, ValueError) as exc:  # upstream indexes and casts fields unchecked
            return refuse(request, 400, f"bad registration: {type(exc).__name__} {exc}"[:300])
        finally:
            if not taken and not known:
                registrants.by_key.pop(key, None)  # refused: the rank is not taken

    app.middlewares.append(check)
