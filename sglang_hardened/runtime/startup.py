"""Refuse PD configurations that defeat the hardening: H7's limits and H5's release setting.

A prefill or decode server whose KV pool holds fewer tokens than its context
length accepts prompts it cannot hold; upstream then substitutes a one-token
placeholder (0.5.19) or rejects late, and decode may read pages nobody wrote
for the request. Refusing to start is cheap and names the remedy.

The same holds across roles: a decode that accepts longer inputs than its
prefill admits requests prefill cannot serve. Prefill registers its input
limit with its bootstrap server (one more field in the registration, which
upstream servers ignore) and serves it on LIMITS_ROUTE (a new route, so an
upstream decode's parsing of /route is untouched); a hardened decode checks
it where upstream checks the page size. Decode does not stop on a mismatch,
since the prefill address can come from a request: that prefill is "not
ready" to upstream, which retries and then fails the requests for it.

H5 holds a failed request's decode pages until prefill's writes drained, on
top of upstream's deferred decode KV release; turning that off
(DEFERRED_ENV=0) would turn H5 off with nothing but a log line, so a hardened
PD server refuses to start with it off unless ALLOW_EARLY_RELEASE.name says so.

H4's notes of the requests prefill ends live in the process that ends them,
and the bootstrap server that serves them to decode runs in the HTTP server's
main process. With ``--tokenizer-worker-num`` above 1 requests end in worker
processes, so decode would never hear of them and would hold each one until
its waiting timeout: such a prefill refuses to start unless
ALLOW_TOKENIZER_WORKERS.name says to go on without H4 (logged).
"""

from __future__ import annotations

import logging
import os
import urllib.error
from collections import OrderedDict
from collections.abc import Mapping

from ..common.knobs import ALLOW_EARLY_RELEASE, ALLOW_TOKENIZER_WORKERS, ALLOW_UNSAFE_KV_LIMITS, Knob
from . import metrics
from .peer_json import READ_ERRORS, get_json, is_int

# One override for both H7 checks: a pool below the context is what makes the
# roles' input limits differ, and tests of the deeper layers need both off.
PD_MODES = ("prefill", "decode")
DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
FALSE_VALUES = ("false", "0", "no", "n")  # what upstream's EnvBool reads as off
LIMITS_ROUTE = "/hardened/limits"
REGISTRATION_FIELD = "hardened_max_req_input_len"

# This scheduler process's input limit (set at start-up; read when it registers
# with, or checks, a bootstrap server in the same process).
_own_input_limit: int | None = None
# On a prefill's bootstrap server (its HTTP process): each rank's registered limit,
# keyed as upstream keys its rank table, so a rank registering again replaces its own.
_rank_limits: dict[tuple, int] = {}
RANKS_MAX = 4096  # rank keys kept; anyone who reaches the port can register one
INPUT_LIMIT_MAX = 1 << 31  # a registered or served limit above this is not a token count
# On decode: what it has logged about a prefill, so a refusal retried every
# scheduling cycle is logged once. Bounded: the address can come from a request.
_said: OrderedDict[tuple, None] = OrderedDict()
SAID_MAX = 1024
LIMITS_READ_MAX = 4096  # bytes of a /hardened/limits reply a decode reads
LIMITS_TIMEOUT_S = 5  # as upstream's own GET of /route

log = logging.getLogger("sglang_hardened")


class UnsafeConfiguration(RuntimeError):
    """A configuration the hardened build refuses to serve with."""


def check_pd_limits(mode: str, pool_tokens: int, context_len: int, max_req_input_len: int) -> None:
    """Seam after the scheduler sizes its pool: record the input limit, check the pool and H5's setting."""
    global _own_input_limit
    _own_input_limit = max_req_input_len
    check_kv_pool(mode, pool_tokens, context_len)
    check_release_setting(mode)


def deferred_release_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether deferred decode KV release is on here (on unless set off: upstream's default from
    0.5.21, the hardened series' on 0.5.19 and 0.5.20)."""
    return environ.get(DEFERRED_ENV, "1").strip().lower() not in FALSE_VALUES


def check_release_setting(mode: str) -> None:
    """Raise on a PD server with deferred release off (unless its override is set, logged)."""
    if mode not in PD_MODES or deferred_release_on():
        return
    message = (
        f"sglang-hardened H5: {DEFERRED_ENV}={os.environ[DEFERRED_ENV]} turns deferred decode KV release "
        f"off, and with it the hold of a failed request's decode pages until prefill's writes into them "
        f"drained: decode would give pages to other requests while a write can still land in them. "
        f"Remedy: unset it. To start anyway, set {ALLOW_EARLY_RELEASE.name}=1 (logged)."
    )
    _refuse_unless_overridden(message, "Starting anyway", ALLOW_EARLY_RELEASE)


def check_launch(server_args) -> None:
    """Seam, the HTTP server's launch before it starts any process: raise for a prefill with more
    than one tokenizer worker (H4 cannot serve their notes), unless its override is set (logged)."""
    workers = getattr(server_args, "tokenizer_worker_num", 1)
    if getattr(server_args, "disaggregation_mode", None) != "prefill" or workers <= 1:
        return
    message = (
        f"sglang-hardened H4: this prefill server has --tokenizer-worker-num {workers}; the requests it "
        f"ends (an oversized prompt, an abort) would end in worker processes, whose notes its bootstrap "
        f"server cannot serve, so decode would hold each one until its waiting timeout. Remedy: "
        f"--tokenizer-worker-num 1 on prefill. To start without H4's notice, set {ALLOW_TOKENIZER_WORKERS.name}=1 "
        f"(logged)."
    )
    _refuse_unless_overridden(message, "Starting without H4's notice", ALLOW_TOKENIZER_WORKERS)


def check_kv_pool(mode: str, pool_tokens: int, context_len: int) -> None:
    """Raise unless a PD server's pool holds a full context (or the override is set, logged)."""
    if mode not in PD_MODES or pool_tokens >= context_len:
        return
    message = (
        f"sglang-hardened H7: this {mode} server's KV pool holds {pool_tokens} tokens, fewer than "
        f"its context length {context_len}; in prefill/decode mode a prompt between the two is "
        f"accepted and cannot be held. Remedy: give the KV pool more memory "
        f"(--mem-fraction-static, --max-total-tokens) or lower --context-length to at most "
        f"{pool_tokens}. To start anyway, set {ALLOW_UNSAFE_KV_LIMITS.name}=1 (logged)."
    )
    _refuse_unless_overridden(message, "Starting anyway")


def _refuse_unless_overridden(message: str, going_on: str, override: Knob = ALLOW_UNSAFE_KV_LIMITS) -> None:
    """Raise ``UnsafeConfiguration`` with ``message`` (logged) unless the operator's override is set."""
    if not _overridden(message, going_on, override):
        log.error(message)
        raise UnsafeConfiguration(message)


def _overridden(message: str, going_on: str, override: Knob = ALLOW_UNSAFE_KV_LIMITS) -> bool:
    """Whether the operator's override is set; if so, log that it overrode ``message``."""
    if not override.get():
        return False
    log.warning("%s %s: %s=1 overrides this check.", message, going_on, override.name)
    return True


def _valid_limit(value: object) -> int | None:
    """``value`` as an input limit, or None when it is not a positive token count."""
    if is_int(value) and 0 < value < INPUT_LIMIT_MAX:
        return value
    return None


def registration_fields() -> dict[str, int]:
    """Extra fields for a prefill rank's bootstrap registration."""
    return {} if _own_input_limit is None else {REGISTRATION_FIELD: _own_input_limit}


def note_registration(rank: tuple, data: dict) -> None:
    """Bootstrap server, after upstream accepted ``rank``'s registration: keep its limit.

    A registration without a valid limit (an upstream rank, or a bad value) leaves the
    rank without one, so nothing pins the served limit once the rank registers again.
    """
    limit = _valid_limit(data.get(REGISTRATION_FIELD))
    if limit is None:
        if data.get(REGISTRATION_FIELD) is not None:
            log.warning("sglang-hardened H7: ignored the input limit registered for rank %s: "
                        "not a positive integer below %d", rank, INPUT_LIMIT_MAX)
        _rank_limits.pop(rank, None)
    elif rank in _rank_limits or len(_rank_limits) < RANKS_MAX:
        _rank_limits[rank] = limit
    else:
        log.warning("sglang-hardened H7: ignored the input limit of rank %s: %d ranks already "
                    "registered one", rank, RANKS_MAX)


def registered_limit() -> int | None:
    """The smallest input limit the ranks registered now hold (None: none registered one)."""
    return min(_rank_limits.values(), default=None)


def add_routes(app) -> None:
    """Bootstrap server: serve the registered limit (aiohttp imported by the caller's module)."""
    from aiohttp import web

    async def limits(_request):
        return web.json_response({"max_req_input_len": registered_limit()})

    app.router.add_get(LIMITS_ROUTE, limits)


def check_prefill_limits(bootstrap_addr: str) -> bool:
    """Decode, each time it asks a prefill for its info: whether that prefill is ready.

    False for a prefill whose input limit is below ours or cannot be read: upstream
    then retries and fails the requests waiting for it. It never raises: the address
    can come from a request body, and an exception here would stop decode's scheduler.
    """
    if _own_input_limit is None:
        return True
    try:
        prefill_limit = _read_limit(bootstrap_addr)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            _say_once(("unhardened", bootstrap_addr), logging.WARNING,
                      f"sglang-hardened H7: prefill at {bootstrap_addr} is not hardened; its input limit "
                      f"cannot be compared with this decode's ({_own_input_limit} tokens)")
            return True
        reason = f"HTTP {exc.code}"
    except READ_ERRORS as exc:
        reason = f"{type(exc).__name__}: {exc}"[:200]
    else:
        if prefill_limit is None or _own_input_limit <= prefill_limit:
            return True
        message = (
            f"sglang-hardened H7: this decode accepts inputs up to {_own_input_limit} tokens but the "
            f"prefill at {bootstrap_addr} only up to {prefill_limit}; a prompt in between would be "
            f"admitted here and cannot be served there. Give both roles the same --context-length "
            f"and KV pools that hold it. To serve anyway, set {ALLOW_UNSAFE_KV_LIMITS.name}=1 (logged)."
        )
        if _overridden(message, "Serving anyway"):
            return True
        metrics.refused("H7", "decode", "limit_below_decode")
        _say_once((bootstrap_addr, prefill_limit), logging.ERROR,
                  f"{message} Requests for this prefill are refused until it registers a limit of at "
                  f"least {_own_input_limit}.")
        return False
    metrics.refused("H7", "decode", "limit_unreadable")
    _say_once(("unreadable", bootstrap_addr), logging.WARNING,
              f"sglang-hardened H7: cannot read the input limit of the prefill at {bootstrap_addr} "
              f"({reason}); requests for it wait, and fail as for a prefill that does not answer")
    return False


def _read_limit(bootstrap_addr: str) -> int | None:
    """The prefill's served limit (None: its ranks registered none); raises on a bad reply."""
    data = get_json(f"http://{bootstrap_addr}{LIMITS_ROUTE}", LIMITS_TIMEOUT_S, LIMITS_READ_MAX)
    if not isinstance(data, dict):
        raise ValueError("reply is not a JSON object")
    value = data.get("max_req_input_len")
    if value is None:
        return None
    if (limit := _valid_limit(value)) is None:
        raise ValueError(f"max_req_input_len is not a positive integer below {INPUT_LIMIT_MAX}")
    return limit


def _say_once(key: tuple, level: int, message: str) -> None:
    """Log ``message`` the first time ``key`` is seen (the last SAID_MAX keys are kept)."""
    if key in _said:
        return
    _said[key] = None
    if len(_said) > SAID_MAX:
        _said.popitem(last=False)
    log.log(level, message)
