"""Decode's deferred-release timeout: what H5's holds and H6's call bounds are measured in.

Upstream frees a failed request's held decode pages after
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT even without prefill's
drain ack; the hardened rules (decode's release guard, prefill's source hold,
NIXL's drain watcher, H6's bytes per call) are all stated in units of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache

RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"


def release_timeout_s(environ: Mapping[str, str]) -> float:
    """Decode's deferred-release timeout in this environment (upstream's default unless set)."""
    from .policy import load_limits

    return float(environ.get(RELEASE_TIMEOUT_ENV, load_limits("release_timeout")["upstream_default_s"]))


@lru_cache(maxsize=1)
def process_release_timeout_s() -> float:
    """``release_timeout_s`` of this process's environment, read once: seams ask on every poll."""
    return release_timeout_s(os.environ)
