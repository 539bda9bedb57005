"""H7: start-up refusal of PD configurations that let a prompt fit one role and not the other.

A prefill or decode server whose KV pool holds fewer tokens than its context
length accepts prompts it cannot hold; upstream then substitutes a one-token
placeholder (0.5.19) or rejects late, and decode may read pages nobody wrote
for the request. Refusing to start is cheap and names the remedy.
"""

from __future__ import annotations

import logging
import os

OVERRIDE_ENV = "SGLANG_HARDENED_ALLOW_SMALL_KV_POOL"
PD_MODES = ("prefill", "decode")

log = logging.getLogger("sglang_hardened")


class UnsafeConfiguration(RuntimeError):
    """A configuration the hardened build refuses to serve with."""


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
    if os.environ.get(OVERRIDE_ENV) == "1":
        log.warning("%s Starting anyway: %s=1 overrides this check.", message, OVERRIDE_ENV)
        return
    log.error(message)
    raise UnsafeConfiguration(message)
