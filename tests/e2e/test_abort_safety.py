"""H9 server-side abort safety: a client that disconnects while its KV is in flight must not
make decode free a page the transfer may still write into. The client talks to both roles
as a load balancer does (bootstrap fields added, prefill and decode called together) and
hangs up on both, as a gateway that drops its backend requests with the client's does.
(mini-lb only notices a disconnect when it writes the first streamed chunk, after the
transfer, so behind it this case does not arise.)

Judged by the page ledger (tests/cpu_overlay/site/sgl_ledger.py, in every build): decode's
page exposures and frees and prefill's write calls, in one clock. The ledger slows each
transfer call of at least 16 pages by a few seconds (a CPU host moves this model's KV in
microseconds), so the disconnect lands while the call is in flight; the write is real and
lands after the wait.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_hardened.policy import load_limits

from tests.conftest import phase

from .conftest import sandbox_env
from .ledger import Ledger, wait_for, writer
from .inflight import send_mid_transfer
from .scenarios import SAFE_PARAMS, core, hang_up, upstream_only, wait_pages_idle

pytestmark = pytest.mark.e2e

SLOW_S = 10.0  # over SGLang's 4 s disconnect poll, so the abort lands mid-call
RELEASE_TIMEOUT_S = load_limits("H6")["release_timeout_s"]  # upstream's default, which these clusters keep


def _disconnect_during_transfer(cluster, folder: Path) -> int:
    """Send SLOW_PROMPT to both roles, hang up on both once prefill's write call into decode has
    begun, wait for that call to return; the room."""
    req = send_mid_transfer(cluster, folder, rid=uuid.uuid4().hex)
    hang_up(list(req.conns.values()))  # the client goes away mid-transfer
    wait_for(folder, "end", timeout_s=SLOW_S + 30)
    return req.room


def _disconnect_case(start_cluster, tmp_path: Path, base: str, hardened: bool) -> tuple[list, float]:
    """(unsafe frees of the room, seconds decode held its pages after the write returned)."""
    folder = tmp_path / "ledger"
    folder.mkdir()
    cluster = start_cluster(sandbox_env(base, hardened=hardened), **SAFE_PARAMS,
                            extra_env=(f"{writer.DIR_ENV}={folder}", f"{writer.SLOW_ENV}={SLOW_S}"))
    idle = cluster.used_tokens()
    with phase(f"scenario disconnect mid-transfer {base} {'hardened' if hardened else 'upstream'}"):
        room = _disconnect_during_transfer(cluster, folder)
        assert wait_pages_idle(cluster, idle) == idle, "pages leaked"
    ledger = Ledger(folder)
    return [u for u in ledger.unsafe_frees() if u.room == room], ledger.held_after_write_s(room)


@pytest.mark.parametrize("base", [b for b, k in upstream_only([("0.5.19", "mooncake")], "0.5.19") if k == "mooncake"
                                  and Version(b) < Version("0.5.21")])
def test_upstream_frees_pages_a_transfer_still_writes_after_a_disconnect(start_cluster, tmp_path, base):
    """0.5.19-0.5.20 ship deferred release off: decode frees the pages as soon as it aborts."""
    unsafe, _ = _disconnect_case(start_cluster, tmp_path, base, hardened=False)
    assert unsafe, "upstream kept every page until the write returned"
    assert all(u.write_end - u.freed_at > 1.0 for u in unsafe), unsafe[:3]


@pytest.mark.parametrize("base", [b for b, k in core() if k == "mooncake"])
def test_hardened_holds_pages_until_the_write_returns_and_no_longer(start_cluster, tmp_path, base):
    """Decode holds the pages until prefill acks that the write drained, then frees them at
    once (not after the release timeout)."""
    unsafe, held_s = _disconnect_case(start_cluster, tmp_path, base, hardened=True)
    assert not unsafe, "\n".join(map(str, unsafe[:5]))
    print(f"{base}: pages freed {held_s:.3f} s after the write returned")
    assert held_s < RELEASE_TIMEOUT_S / 2, f"held {held_s:.1f} s: the drain ack was lost, the timeout freed them"
