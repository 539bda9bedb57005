"""`sglang-hardened lb` in front of upstream 0.5.19 (whose decode frees an aborted request's
pages at once, mid-transfer: test_fault_matrix's client hang-up): a client that hangs up at any phase leaves
no page leaked and no write landing in a freed page, judged by the page ledger.

The ledger slows each large write call (tests/cpu_overlay/site/sgl_ledger.py), so the
phases around the transfer can be hit on a CPU host: the LB cannot see the KV send start,
so it waits for prefill's answer or decode's first output before it aborts decode.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_hardened.sandbox.cluster import Cluster
from sglang_hardened.sandbox.ledger import Ledger, ledger_env, wait_for, writer

from tests.harness import phase

from .conftest import launch, sandbox_env
from .scenarios import SAFE_PARAMS, SLOW_PROMPT, hang_up, post, wait_pages_idle

pytestmark = pytest.mark.e2e

BASE = "0.5.19"
SLOW_S = 4.0
LONG_OUTPUT = 400  # decode runs for seconds after the transfer


@pytest.fixture(scope="module")
def ledger_cluster(tmp_path_factory) -> Iterator[tuple[Cluster, Path, dict[str, int]]]:
    """The cluster, its ledger folder, and the KV tokens each role holds when idle."""
    folder = tmp_path_factory.mktemp("ledger")
    cluster = launch(sandbox_env(BASE), **SAFE_PARAMS, lb="hardened",
                     extra_env=ledger_env(folder, SLOW_S))
    yield cluster, folder, cluster.used_tokens()
    cluster.stop()


def _hang_up_at(cluster: Cluster, folder: Path, when: str) -> None:
    """Send SLOW_PROMPT through the LB, hang up at phase ``when``, and wait until decode has
    freed some of the request's pages (so the next phase starts from an idle cluster)."""
    sent = time.monotonic()
    conn = post(cluster.lb_url, {"text": SLOW_PROMPT, "stream": when == "mid-stream",
                                 "sampling_params": {"temperature": 0.0, "max_new_tokens": LONG_OUTPUT}})
    if when == "after-bootstrap":  # decode has sent prefill its page indices
        wait_for(folder, "expose", writer.SLOW_MIN_PAGES, after=sent)
    elif when == "during-transfer":
        wait_for(folder, "begin", writer.SLOW_MIN_PAGES, after=sent)
    elif when == "during-decode":
        wait_for(folder, "end", after=sent)
    elif when == "mid-stream":
        response = conn.getresponse()
        assert response.status == 200, response.read()[:300]
        assert response.readline().startswith(b"data:")  # the first streamed chunk
    hang_up([conn])
    exposure = wait_for(folder, "expose", writer.SLOW_MIN_PAGES, after=sent)
    wait_for(folder, "free", timeout_s=SLOW_S + 60, after=exposure["t"])


@pytest.mark.parametrize("when", ["before-bootstrap", "after-bootstrap", "during-transfer", "during-decode",
                                  "mid-stream"])
def test_client_hang_up_at_any_phase_frees_no_page_being_written(ledger_cluster, request, when):
    cluster, folder, idle = ledger_cluster
    request.node.sandbox_clusters = [cluster]
    with phase(f"scenario lb hang-up {when} {BASE} upstream"):
        _hang_up_at(cluster, folder, when)
        used = wait_pages_idle(cluster, idle, timeout_s=SLOW_S + 60)
    unsafe = Ledger(folder).unsafe_frees()
    assert not unsafe, "\n".join(map(str, unsafe[:5]))
    assert used == idle, f"pages leaked after a hang-up {when}: {used} != {idle}"
    assert "client gone" in cluster.log_tail("lb", 400), "the LB never saw the client go"
