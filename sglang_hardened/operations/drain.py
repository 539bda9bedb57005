"""Drain a server before its pod stops: the recipe's preStop hook.

Kubernetes marks a pod for deletion, runs its preStop hook, then sends SIGTERM and, after the
grace period, SIGKILL. smg drops a pod from its pool once the pod is marked (its service
discovery watches for that), so no new request reaches it; the requests it already holds must
still finish, or the clients that sent them get an error (a decode killed mid-answer) and a
prefill killed mid-transfer leaves its decode waiting. The hook waits until the server holds no
request and no KV page (SGLang's /v1/loads on every DP rank), then lets SIGTERM through.
"""

from __future__ import annotations

import json
import time
import urllib.request

from ..common.errors import HardenedError

# what a rank still holds: requests running or queued (the PD queues included), and KV pages
BUSY_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")


def held(url: str, timeout: float = 10.0) -> int:
    """Requests and KV tokens the server at `url` still holds, summed over its ranks."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/loads", timeout=timeout) as reply:
            loads = json.load(reply)["loads"]
    except (OSError, ValueError, KeyError) as exc:
        raise HardenedError(f"cannot read {url}/v1/loads: {exc}") from None
    return sum(int(load.get(field) or 0) for load in loads for field in BUSY_FIELDS)


def drain(url: str, settle_s: float, timeout_s: float, poll_s: float = 1.0) -> float:
    """Wait `settle_s` (smg sees the pod marked and stops sending to it), then until the server is
    idle on two polls in a row; return the seconds waited. Past `timeout_s` it raises, naming what
    is still held (the grace period then decides)."""
    start = time.monotonic()
    time.sleep(settle_s)
    idle_polls = 0
    while idle_polls < 2:
        now = held(url)
        idle_polls = idle_polls + 1 if now == 0 else 0
        if now and time.monotonic() - start > timeout_s:
            raise HardenedError(f"{url} still holds {now} requests and KV tokens after {timeout_s:.0f} s")
        if idle_polls < 2:
            time.sleep(poll_s)
    return time.monotonic() - start
