"""The servers a gateway routes to: the SGLang Model Gateway's worker pool, for the preflight gate.

With service discovery, smg's pool is whatever pods it found (and whatever an admin added by
hand): the gate judges exactly those, each on its own, rather than one pod of a Service picked
at random. smg lists its pool on `GET /workers`, an admin route: the key comes from KEY_ENV
(the recipe fills it from the Secret), never from the command line, where a process list shows it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from ..common.errors import HardenedError

KEY_ENV = "GATEWAY_ADMIN_KEY"
ROLES = ("prefill", "decode")


def pool(gateway: str, timeout: float, key: str | None = None) -> dict[str, list[str]]:
    """Each role's server URLs in smg's pool at `gateway`, sorted; refused when smg cannot be read
    or routes to no server of a role (nothing would serve, and nothing is judged). The admin key
    is `key`, else KEY_ENV's value."""
    url = gateway.rstrip("/") + "/workers"
    key = os.environ.get(KEY_ENV, "") if key is None else key
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            workers = json.load(reply)["workers"]
    except urllib.error.HTTPError as exc:
        hint = f" (is {KEY_ENV} smg's admin key?)" if exc.code in (401, 403) else ""
        raise HardenedError(f"{url} answered {exc.code}{hint}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HardenedError(f"cannot read the gateway's worker pool at {url}: {exc}") from None
    found = {role: sorted(w["url"] for w in workers if w.get("worker_type") == role and isinstance(w.get("url"), str))
             for role in ROLES}
    empty = [role for role, urls in found.items() if not urls]
    if empty:
        raise HardenedError(f"the gateway at {gateway} routes to no {' and no '.join(empty)} server: "
                            "smg has found none Ready yet, or cannot list the pods (its Role, its network policy)")
    return found
