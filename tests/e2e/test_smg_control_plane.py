"""The SGLang Model Gateway's control plane (`/workers`) is closed to whoever holds no key.

smg serves its admin routes on the clients' port. Started with no control-plane key (the recipe
and the sandbox before the review that found it), one unauthenticated `DELETE /workers/<decode id>` took the service
down ("No available decode workers") and `POST /workers` registered any URL, so a tenant could
put a server of its own in the decode pool and read other tenants' prompts. Both now start smg
with an admin key (`--control-plane-api-keys`; the recipe from a Secret, the sandbox a fresh one
per start): a request without it gets 401, and the key holder still lists the workers.

Tier: the full run (no claim). Cost: one smg start in front of the shared upstream 0.5.23
cluster of test_lb.py and test_upstream_defaults.py (no cluster start of its own where those
run; alone, that cluster's start, 33 s) and a few requests: 2.4 s with the cluster up
(2026-12-06, 2 cores under another test run's load).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from sglang_hardened.operations.deploy_wiring import SMG_KEYS_FLAG
from sglang_hardened.operations.oracle import generate
from sglang_hardened.sandbox.cluster import Cluster

from .conftest import sandbox_env
from .scenarios import TIMEOUT_PARAMS

pytestmark = pytest.mark.e2e
CLUSTER = ("0.5.23", False, TIMEOUT_PARAMS)  # the gate's shared upstream cluster: this adds only smg
REFUSED = (401, 403)


def call(url: str, method: str, path: str, key: str = "", body: dict | None = None) -> tuple[int, str]:
    """One control-plane request: (status, text); ``key`` as smg's admin bearer token."""
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def admin_key(cluster: Cluster, name: str) -> str:
    """The key the gateway `name` was started with, as its operator holds it ('' if none)."""
    cmd = cluster.procs[name].cmd
    return cmd[cmd.index(SMG_KEYS_FLAG) + 1].split(":", 3)[3] if SMG_KEYS_FLAG in cmd else ""


def test_smg_refuses_worker_changes_without_its_key_and_keeps_serving(shared_cluster):
    url = shared_cluster.add_lb("smg", sandbox_env("0.5.23"))
    key = admin_key(shared_cluster, "lb-smg")
    status, text = call(url, "GET", "/workers", key)
    assert status == 200, (status, text)
    [decode] = [w for w in json.loads(text)["workers"] if w["worker_type"] == "decode"]

    deleted = call(url, "DELETE", f"/workers/{decode['id']}")
    assert deleted[0] in REFUSED, f"an unauthenticated DELETE of the decode worker was accepted: {deleted}"
    added = call(url, "POST", "/workers", body={"url": "http://127.0.0.2:9", "worker_type": "decode"})
    assert added[0] in REFUSED, f"an unauthenticated worker registration was accepted: {added}"
    assert call(url, "GET", "/workers", "not-the-key")[0] in REFUSED
    assert call(url, "GET", "/workers")[0] in REFUSED  # the pool's addresses are the operator's too

    assert generate(url, "the gateway still serves", timeout=120).status == 200
    status, text = call(url, "GET", "/workers", key)
    assert status == 200, (status, text)
    assert {w["url"] for w in json.loads(text)["workers"]} == {shared_cluster.prefill_url, shared_cluster.decode_url}
