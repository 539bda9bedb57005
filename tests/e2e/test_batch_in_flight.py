"""A batch in flight on MLA: decode releases a failed request's pages (H5) while its overlap loop
runs an unfinished batch, upstream against hardened 0.5.23 over Mooncake, on the tiny DeepSeek V3
(MLA's latent KV pool), one fault cluster per build.

On a GPU the overlap loop launches batch k and runs decode's PD queues (transfers, H3's and H8's
checks, H13's gate, H5's releases) before batch k's result is in; on CPU every forward has ended
by then. Here each forward's result is released later than it returns (``--inflight``:
``tests/cpu_overlay/site/sgl_inflight.py`` says why that event is the stand-in: a GPU batch still
running), and a long request keeps decode's loop in batches while the fault matrix's stalled
prefill (``prefill_stopped_past_the_release_timeout``) is caught: the page ledger stamps each of
decode's frees with the batches unfinished then, so the test sees H5's release happen beside
one. Upstream frees under the stalled write; hardened holds the pages until the drain ack.

Tier: gate (H5's pair on this shape: the one MLA case and the one in-flight case the gate
carries, in one cluster per build). Cost, measured 2026-12-06 on this 2-core host at a load of
16 (``scripts/test tests/e2e/test_batch_in_flight.py -k releases``): 207 s, two cluster starts
152 s of it (a start is 20-30 s on a quiet host), each case about 27 s. The per-base loop check
runs in the weekly full matrix.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from sglang_hardened.operations.oracle import Reply, generate
from sglang_hardened.sandbox.env import bases
from sglang_hardened.sandbox.ledger import Ledger

from .inflight import InFlight, abort_request
from .scenarios import FITTING_C, FULL_MATRIX, TIMEOUT_PARAMS
from .test_fault_matrix import PARAMS, Build, FaultCluster, on, prefill_stopped_past_the_release_timeout, \
    start_fault_cluster

pytestmark = pytest.mark.e2e

OVERLAP_LOOPS = {"prefill": {"event_loop_overlap_disagg_prefill"}, "decode": {"event_loop_overlap_disagg_decode"}}
BUILDS = [Build("0.5.23", "mooncake", hardened, mla=True, inflight=True) for hardened in (False, True)]
BUSY_TOKENS = 800  # decoded one step per in-flight delay: longer than the case, which ends it
FREED_WITHIN_S = 60  # the stalled room's pages are back by then (upstream: the timeout; hardened: the ack)


@pytest.fixture(scope="module")
def fc(request, tmp_path_factory):
    """The build's fault cluster on MLA in the in-flight mode; stopped before the next build's."""
    fault_cluster = start_fault_cluster(request.param, tmp_path_factory.mktemp("instruments"), PARAMS)
    yield fault_cluster
    fault_cluster.cluster.stop()


class Busy:
    """One long request through the load balancer, so decode's overlap loop runs a batch at every
    pass until ``end`` aborts it on both roles."""

    def __init__(self, fc: FaultCluster) -> None:
        self.fc, self.rid, self.reply = fc, uuid.uuid4().hex, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline, held = time.monotonic() + 60, []
        while len(set(held)) < 3 and time.monotonic() < deadline:  # until its KV grows: decode's batches run it
            if (used := fc.cluster.used_tokens()["decode"]) > fc.idle["decode"]:
                held.append(used)
            time.sleep(0.2)
        assert len(set(held)) >= 3, f"decode never ran the busy request: {held}"

    def _run(self) -> None:
        self.reply: Reply = generate(self.fc.cluster.lb_url, FITTING_C, BUSY_TOKENS, timeout=600,
                                     extra={"rid": self.rid, "sampling_params": {
                                         "temperature": 0.0, "max_new_tokens": BUSY_TOKENS, "ignore_eos": True}})

    def end(self) -> Reply:
        for role in ("decode", "prefill"):
            abort_request(self.fc.cluster, role, self.rid)
        self.thread.join(60)
        return self.reply


@pytest.mark.claim("H5", "upstream", params=["0.5.23-mooncake-upstream-mla-inflight"])
@pytest.mark.claim("H5", "hardened", params=["0.5.23-mooncake-hardened-mla-inflight"])
@on(BUILDS)
def test_decode_releases_beside_an_unfinished_batch(fc):
    """The stalled prefill's room, on MLA with decode's loop a batch ahead: upstream frees its
    pages under the write, hardened holds them until the write returned (the fault matrix's
    judgement); decode's first free of them came with a batch unfinished (the ledger's stamp)."""
    busy = Busy(fc)

    def settle(req: InFlight) -> None:
        deadline = time.monotonic() + FREED_WITHIN_S
        while not (frees := Ledger(fc.ledger_dir).frees_of(req.room)) and time.monotonic() < deadline:
            time.sleep(0.5)
        freed = frees[0] if frees else {}
        print(f"\n{fc.name}: decode freed room {req.room}'s pages with {freed.get('in_flight')} batch(es) in flight")
        assert busy.end() is not None, "the busy request never answered"
        assert freed.get("in_flight", 0) >= 1, freed

    assert fc.cluster.event_loops() == OVERLAP_LOOPS
    prefill_stopped_past_the_release_timeout(fc, settle)


@pytest.mark.skipif(not FULL_MATRIX, reason="the weekly full matrix: every run's summary lists the loops its starts ran")
@pytest.mark.parametrize("base", bases())
def test_every_base_runs_the_overlap_loops(share, base):
    """Which loop each role's scheduler entered, as it logged it (not what its arguments imply):
    upstream's overlap loops for PD on every base, the CPU's too. The weekly full matrix only (a
    start per base where the run shares none; 1343 s alone with four environments cold, 5 starts
    476 s of it); every run's summary lists what its own starts ran."""
    assert share(base, **TIMEOUT_PARAMS).event_loops() == OVERLAP_LOOPS
