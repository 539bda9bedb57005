"""Through the SGLang Model Gateway (`smg`, the Rust successor of sglang-router that upstream's
recipes put in front of PD): what a client gets for a prompt over prefill's KV pool, and what a
client that hangs up mid-transfer leaves on decode, upstream 0.5.23 against hardened 0.5.23.
Measured (2026-12-03, this test with -s): smg relays prefill's 400 for an over-pool prompt at
once on both builds (mini-lb makes upstream's client wait out decode's timeout), and a hang-up
mid-transfer frees no page under a write on either build (0.5.23 defers decode's release).
In front of upstream 0.5.19 the same hang-up frees pages a write still lands in: smg drops
both backend requests with its client's, the naive balancer H9 is about.

The gateway is upstream's, pinned in the sandbox pins and started in PD mode with the prefill
URL and bootstrap port; the page ledger judges the hang-up (writes are slowed so one can be hit
mid-transfer). Cost: a cluster start and a hang-up of a few seconds per build; CI runs the
hardened 0.5.23 one and upstream 0.5.19's hang-up.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sglang_hardened.sandbox.cluster import Cluster
from sglang_hardened.sandbox.ledger import Ledger, ledger_env, wait_for, writer

from tests.harness import phase

from .conftest import record_timing, sandbox_env
from .scenarios import (
    DEPTH,
    FULL_MATRIX,
    OVERSIZED_B,
    SAFE_PARAMS,
    SLOW_PROMPT,
    TIMEOUT_PARAMS,
    before_decode_gives_up,
    hang_up,
    post,
    wait_pages_idle,
)

pytestmark = pytest.mark.e2e

BASE, BACKEND = "0.5.23", "mooncake"
# CI runs the hardened cluster; upstream's (the same answers, shown on 2026-12-03) runs in the full matrix
BUILDS = ["upstream", "hardened"] if FULL_MATRIX else ["hardened"]
PREFILL_LIMIT_MESSAGE = "exceeds the maximum allowed length"
SLOW_S = 4.0


@pytest.mark.parametrize("build", BUILDS)
def test_over_pool_prompt_and_hang_up_through_smg(start_cluster, tmp_path, build):
    hardened = build == "hardened"
    depth = DEPTH["extra_env"] if hardened else ()
    cluster = start_cluster(sandbox_env(BASE, hardened=hardened), backend=BACKEND, lb="smg",
                            **TIMEOUT_PARAMS, extra_env=(*depth, *ledger_env(tmp_path, SLOW_S)))
    idle = cluster.used_tokens()
    with phase(f"scenario over-pool via smg {BASE} {build}"):
        reply = cluster.generate(OVERSIZED_B, timeout=cluster.params.waiting_timeout_s * 4 + 60)
    record_timing("oversized via smg", BASE, BACKEND, build, reply)
    print(f"\nover-pool prompt via smg, {build}: HTTP {reply.status} in {reply.seconds:.1f} s")
    # smg relays prefill's 400 at once, upstream's too (mini-lb waits for decode's answer)
    assert reply.status == 400 and PREFILL_LIMIT_MESSAGE in reply.body, reply
    assert before_decode_gives_up(cluster, reply), reply.seconds
    assert wait_pages_idle(cluster, idle) == idle

    unsafe = _hang_up_mid_transfer(cluster, tmp_path, idle, f"{BASE} {build}")
    assert not unsafe, "\n".join(map(str, unsafe[:5]))


def test_a_hang_up_through_smg_frees_pages_under_a_write_on_upstream_0519(start_cluster, tmp_path):
    """H9's harm behind a real gateway: smg drops both backend requests when its client hangs
    up, and upstream 0.5.19's decode (deferred release off) frees the pages prefill's write is
    still landing in. `sglang-hardened lb` in front of the same servers frees none
    (test_lb_disconnect.py); hardened servers hold them behind any balancer (above)."""
    cluster = start_cluster(sandbox_env("0.5.19"), backend=BACKEND, lb="smg", **SAFE_PARAMS,
                            extra_env=ledger_env(tmp_path, SLOW_S))
    unsafe = _hang_up_mid_transfer(cluster, tmp_path, cluster.used_tokens(), "0.5.19 upstream")
    assert unsafe, "smg's hang-up freed no page under a write: the harm is not shown"


def _hang_up_mid_transfer(cluster: Cluster, folder: Path, idle: dict[str, int], label: str) -> list:
    """Hang up on a request through the gateway once prefill's slowed write has begun; return
    the pages the ledger saw freed under a write (pages must come back either way)."""
    with phase(f"scenario hang-up via smg {label}"):
        sent = time.monotonic()
        conn = post(cluster.lb_url, {"text": SLOW_PROMPT, "sampling_params": {"temperature": 0.0,
                                                                             "max_new_tokens": 400}})
        wait_for(folder, "begin", writer.SLOW_MIN_PAGES, after=sent)
        hung_up = time.monotonic()
        hang_up([conn])
        used = wait_pages_idle(cluster, idle, timeout_s=SLOW_S + 60)
        back_s = time.monotonic() - hung_up
    unsafe = Ledger(folder).unsafe_frees()
    print(f"hang-up mid-transfer via smg, {label}: pages back {back_s:.1f} s after it, {len(unsafe)} freed under a write")
    assert used == idle, f"pages leaked after a hang-up: {used} != {idle}"
    return unsafe
