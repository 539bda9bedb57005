"""H7: refuse PD configurations that let a prompt fit one role and not the other.

A prefill or decode server whose KV pool holds fewer tokens than its context
length accepts prompts it cannot hold; upstream then substitutes a one-token
placeholder (0.5.19) or rejects late, and decode may read pages nobody wrote
for the request. Refusing to start is cheap and names the remedy.

The same holds across roles: a decode that accepts longer inputs than its
prefill admits requests prefill cannot serve. Prefill registers its input
limit with its bootstrap server (one more field in the registration, which
upstream servers ignore) and serves it on LIMITS_ROUTE (a new route, so an
upstream decode's parsing of /route is untouched); a hardened decode checks
it when it first meets that prefill, as upstream checks the page size there.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request

# One override for both H7 checks: a pool below the context is what makes the
# roles' input limits differ, and tests of the deeper layers need both off.
OVERRIDE_ENV = "SGLANG_HARDENED_ALLOW_UNSAFE_KV_LIMITS"
PD_MODES = ("prefill", "decode")
LIMITS_ROUTE = "/hardened/limits"
REGISTRATION_FIELD = "hardened_max_req_input_len"

# This scheduler process's input limit (set at start-up; read when it registers
# with, or checks, a bootstrap server in the same process).
_own_input_limit: int | None = None
# On a prefill's bootstrap server (its HTTP process): the smallest limit its ranks registered.
_registered_input_limit: int | None = None
_unhardened_peers_warned: set[str] = set()

log = logging.getLogger("sglang_hardened")


class UnsafeConfiguration(RuntimeError):
    """A configuration the hardened build refuses to serve with."""


def check_pd_limits(mode: str, pool_tokens: int, context_len: int, max_req_input_len: int) -> None:
    """Seam after the scheduler sizes its pool: record the input limit, check the pool."""
    global _own_input_limit
    _own_input_limit = max_req_input_len
    check_kv_pool(mode, pool_tokens, context_len)


def check_kv_pool(mode: str, pool_tokens: int, context_len: int) -> None:
    """Raise unless a PD server's pool holds a full context (or the override is set, logged)."""
    if mode not in PD_MODES or pool_tokens >= context_len:
        return
    message = (
        f"sglang-hardened H7: this {mode} server's KV pool holds {pool_tokens} tokens, fewer than "
        f"its context length {context_len}; in prefill/decode mode a prompt between the two is "
        f"accepted and cannot be held. Remedy: give the KV pool more memory "
        f"(--mem-fraction-static, --max-total-tokens) or lower --context-length to at most "
        f"{pool_tokens}. To start anyway, set {OVERRIDE_ENV}=1 (logged)."
    )
    _refuse(message, "Starting anyway")


def _refuse(message: str, going_on: str) -> None:
    """Raise UnsafeConfiguration, unless the operator's override is set: then log that it was."""
    if os.environ.get(OVERRIDE_ENV) == "1":
        log.warning("%s %s: %s=1 overrides this check.", message, going_on, OVERRIDE_ENV)
        return
    log.error(message)
    raise UnsafeConfiguration(message)


def registration_fields() -> dict[str, int]:
    """Extra fields for a prefill rank's bootstrap registration."""
    return {} if _own_input_limit is None else {REGISTRATION_FIELD: _own_input_limit}


def note_registration(data: dict) -> None:
    """Bootstrap server: keep the smallest input limit any prefill rank registered."""
    global _registered_input_limit
    value = data.get(REGISTRATION_FIELD)
    if value is not None:
        value = int(value)
        _registered_input_limit = value if _registered_input_limit is None else min(_registered_input_limit, value)


def add_routes(app) -> None:
    """Bootstrap server: serve the registered limit (aiohttp imported by the caller's module)."""
    from aiohttp import web

    async def limits(_request):
        return web.json_response({"max_req_input_len": _registered_input_limit})

    app.router.add_get(LIMITS_ROUTE, limits)


def check_prefill_limits(bootstrap_addr: str) -> None:
    """Decode, on first meeting a prefill: refuse one whose input limit is below ours."""
    if _own_input_limit is None:
        return
    try:
        with urllib.request.urlopen(f"http://{bootstrap_addr}{LIMITS_ROUTE}", timeout=5) as reply:
            prefill_limit = json.load(reply).get("max_req_input_len")
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and bootstrap_addr not in _unhardened_peers_warned:
            _unhardened_peers_warned.add(bootstrap_addr)
            log.warning("sglang-hardened H7: prefill at %s is not hardened; its input limit "
                        "cannot be compared with this decode's (%d tokens)", bootstrap_addr, _own_input_limit)
        return
    if prefill_limit is not None and _own_input_limit > int(prefill_limit):
        message = (
            f"sglang-hardened H7: this decode accepts inputs up to {_own_input_limit} tokens but the "
            f"prefill at {bootstrap_addr} only up to {prefill_limit}; a prompt in between would be "
            f"admitted here and cannot be served there. Give both roles the same --context-length "
            f"and KV pools that hold it. To serve anyway, set {OVERRIDE_ENV}=1 (logged)."
        )
        _refuse(message, "Serving anyway")
