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

On the same clusters, the full tier adds the checks decode runs on a request's pages before its
first step, and H4's end of a request prefill ended, each with a busy request decoding beside it:
the truncation's request (prefill sent the prompt as its limit truncates it, decode the whole: the
roles' limits here agree, so this stands in for ``--allow-auto-truncate`` below decode's limit)
and a page prefill's sender leaves out (``drop-last-page``), after other tenants' histories
(the differential oracle); upstream answers 200 over pages no write covered (the ledger) and
over the page left out (the oracle), hardened refuses them naming H3 and H8. Then prefill alone
aborted mid-write: upstream's decode never answers and holds the pages, hardened's answers an
error. With one-token pages decode's own H3 check (prompt lengths within one page) never runs:
the sender's coverage check refuses first; ``test_mla.py`` shows decode's own on 64-token pages.

Tier: gate for H5's pair (the one MLA case and the one in-flight case the gate carries, in one
cluster per build); full for the H3 and H8 case and H4's, on the same clusters: no start added.
Cost, measured 2026-12-06 on this 2-core host: the gate's selection (``scripts/test
tests/e2e/test_batch_in_flight.py -k releases``) 207 s at a load of 16, two cluster starts 152 s of
it (a start is 20-30 s on a quiet host), each case about 27 s; the whole module (``scripts/test
tests/e2e/test_batch_in_flight.py``) 309 s at a load of 2-8, 527-551 s at 12-36, the starts 25-174 s
each, the H3 and H8 case 68-109 s per build, H4's 11 s (hardened) and 30-31 s (upstream). The per-base loop
check runs in the weekly full matrix.
"""

from __future__ import annotations

import time

import pytest

from sglang_hardened.operations.oracle import Reply
from sglang_hardened.sandbox.env import bases, overlay_module
from sglang_hardened.sandbox.instruments import SLOW_S
from sglang_hardened.sandbox.ledger import Ledger, wait_for

from .inflight import Busy, InFlight, beside_busy, in_flight_at
from .scenarios import (FITTING_C, FULL_MATRIX, LAST_PAGE, LAST_PAGE_TOKENS, TIMEOUT_PARAMS, TRUNC_PREFILL_TOKENS,
                        observe_pair, observe_probes, prompt_of, replies, shows_nothing_decoded, wait_pages_idle)
from .test_fault_matrix import PARAMS, Build, FaultCluster, on, prefill_stopped_past_the_release_timeout, \
    start_fault_cluster
from .test_oversized import unowned_reads
from .test_page_tags import REFUSED

pytestmark = pytest.mark.e2e

OVERLAP_LOOPS = {"prefill": {"event_loop_overlap_disagg_prefill"}, "decode": {"event_loop_overlap_disagg_decode"}}
BUILDS = [Build("0.5.23", "mooncake", hardened, mla=True, inflight=True) for hardened in (False, True)]
FREED_WITHIN_S = 60  # the stalled room's pages are back by then (upstream: the timeout; hardened: the ack)
faults = overlay_module("sgl_faults")
# The injected faults hit transfers of two pages and more (one page: the readiness probe), so the
# page a fault leaves out of a short prompt is a large share of what decode attends to.
FAULT_ENV = (f"{faults.MIN_PAGES_ENV}=2",)


@pytest.fixture(scope="module")
def fc(request, tmp_path_factory):
    """The build's fault cluster on MLA in the in-flight mode; stopped before the next build's."""
    fault_cluster = start_fault_cluster(request.param, tmp_path_factory.mktemp("instruments"), PARAMS, FAULT_ENV)
    yield fault_cluster
    fault_cluster.cluster.stop()


@pytest.mark.claim("H5", "upstream", params=["0.5.23-mooncake-upstream-mla-inflight"])
@pytest.mark.claim("H5", "hardened", params=["0.5.23-mooncake-hardened-mla-inflight"])
@on(BUILDS)
def test_decode_releases_beside_an_unfinished_batch(fc):
    """The stalled prefill's room, on MLA with decode's loop a batch ahead: upstream frees its
    pages under the write, hardened holds them until the write returned (the fault matrix's
    judgement); decode's first free of them came with a batch unfinished (the ledger's stamp)."""
    busy = Busy(fc.cluster, fc.idle["decode"])

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


# The checks decode runs on a request's pages before its first step, each met with decode's loop a
# batch ahead (the full tier, on the clusters above). LAST_PAGE: prefill is sent the prompt as its
# limit truncates it (TRUNCATED: 506 positions, the first 505 decode's), decode the whole (530): the
# truncation's request on roles whose limits agree, so these clusters host it (H3). UNTAGGED:
# prefill's sender leaves its last page out (drop-last-page, H8): one of its four positions
# (with one of 17, test_page_tags.py's probe, the tiny DeepSeek's output moved once in four reads).
# FITTING_C: neither.
TRUNCATED = prompt_of(TRUNC_PREFILL_TOKENS)
UNTAGGED_TOKENS = 4
UNTAGGED = prompt_of(UNTAGGED_TOKENS)
PROBES = {"truncated": LAST_PAGE, "untagged": UNTAGGED, "control": FITTING_C}
ENDED_WITHIN_S = SLOW_S + 20  # the slowed write, then H4's note; upstream's decode waits its 300 s timeout


def _probe(fc: FaultCluster, prompt: str) -> Reply:
    """One of PROBES, its fault on for it alone; the client sees decode's answer."""
    fc.fault_file.write_text("drop-last-page" if prompt == UNTAGGED else "")
    try:
        if prompt == LAST_PAGE:
            return observe_pair(fc.cluster, prompt, prefill_prompt=TRUNCATED)[1]
        return fc.cluster.generate(prompt)
    finally:
        fc.fault_file.write_text("")


@pytest.mark.full
@on(BUILDS)
def test_decode_checks_pages_beside_an_unfinished_batch(fc):
    """H3 and H8 with decode's loop a batch ahead, each probe after other tenants' histories (the
    differential oracle) with a busy request decoding beside it. Upstream answers 200 over pages no
    transfer covered (the ledger: positions 506-529 of LAST_PAGE came from no write for the
    request) and over a page left out (its output moves with the tenant before); hardened refuses
    each, naming H3 and H8, with nothing decoded. Each probe's pages were freed (hardened: on its
    refusal) with a batch in flight (the ledger's stamp; the exposure's is printed: one of 8 read 0
    in one run of four), and no page is held after."""
    since = time.monotonic()  # the ledger's clock: the start's own short requests came before
    v = observe_probes(fc.cluster, PROBES, beside_busy(fc.cluster, lambda prompt: _probe(fc, prompt)))
    print({name: {label: v[name].outputs(label) for label in v[name].replies} for name in v})
    assert fc.cluster.log_tail("prefill", 10**6).count("SANDBOX PAGE FAULT drop-last-page:") >= 4
    assert all(r.status == 200 for r in replies(v["control"])) and not v["control"].leaked, v["control"].replies
    ledger = Ledger(fc.ledger_dir)
    rooms = [e["room"] for e in ledger.of("expose") if e["tokens"] in (LAST_PAGE_TOKENS, UNTAGGED_TOKENS)
             and e["t"] > since]
    stamps = {room: in_flight_at(ledger, room) for room in rooms}
    print(f"\n{fc.name}: batches in flight (at exposure, at the first free) per probe: {list(stamps.values())}")
    assert len(stamps) == 8 and all(freed >= 1 for _, freed in stamps.values()), stamps
    if fc.hardened:
        for name, hid in (("truncated", "sglang-hardened H3"), ("untagged", REFUSED)):
            assert all(r.status == 500 and hid in r.body for r in replies(v[name])), v[name].replies
            assert shows_nothing_decoded(v[name]), v[name].replies
    else:
        assert all(r.status == 200 for name in ("truncated", "untagged") for r in replies(v[name]))
        uncovered = unowned_reads(fc.ledger_dir, LAST_PAGE_TOKENS)
        assert len(uncovered) == 4 and all(
            [r.position for r in reads] == list(range(TRUNC_PREFILL_TOKENS, LAST_PAGE_TOKENS))
            and all(r.slot is None for r in reads) for reads in uncovered), uncovered
        assert v["untagged"].leaked, v["untagged"].replies
    assert wait_pages_idle(fc.cluster, fc.idle) == fc.idle, "pages leaked"
    assert not [u for u in ledger.unsafe_frees() if u.room in stamps], "a probe's page freed under its write"


@pytest.mark.full
@on(BUILDS)
def test_decode_ends_a_request_prefill_ended_beside_an_unfinished_batch(fc):
    """H4 with decode's loop a batch ahead: prefill alone is aborted while its write into decode
    runs (the fault matrix's prefill abort), a busy request decoding beside. Upstream's decode is
    never told: no answer within ENDED_WITHIN_S and the request's pages still held (the ledger: no
    free of them), until the client's abort; hardened decode answers an error with nothing decoded
    within it, its pages freed with a batch in flight. No page is freed under the write."""
    busy = Busy(fc.cluster, fc.idle["decode"])
    req = fc.catch_mid_transfer()
    req.read_answers(120)
    fc.abort("prefill", req.rid)
    ans = req.answer("decode", timeout_s=ENDED_WITHIN_S)
    deadline = time.monotonic() + (FREED_WITHIN_S if ans.status is not None else 0)
    while not (freed := Ledger(fc.ledger_dir).frees_of(req.room)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if ans.status is None:
        fc.abort("decode", req.rid)  # what the client's hang-up would do, so the next case starts idle
    busy.end()
    wait_for(fc.ledger_dir, "end", timeout_s=SLOW_S + 30, after=req.sent_at)
    print(f"\n{fc.name}: decode answered {ans.status} after {ans.seconds:.1f} s; "
          + (f"freed the room's pages with {freed[0].get('in_flight')} batch(es) in flight" if freed
             else "held the room's pages"))
    assert wait_pages_idle(fc.cluster, fc.idle) == fc.idle, "pages leaked"
    assert not fc.unsafe(req.room), "decode freed a page under the write"
    if fc.hardened:
        assert ans.status is not None and ans.status != 200 and '"output_ids"' not in ans.body, ans
        assert freed and freed[0].get("in_flight", 0) >= 1, freed
    else:
        assert ans.status is None and not freed, (ans, freed)


@pytest.mark.skipif(not FULL_MATRIX, reason="the weekly full matrix: every run's summary lists the loops its starts ran")
@pytest.mark.parametrize("base", bases())
def test_every_base_runs_the_overlap_loops(share, base):
    """Which loop each role's scheduler entered, as it logged it (not what its arguments imply):
    upstream's overlap loops for PD on every base, the CPU's too. The weekly full matrix only (a
    start per base where the run shares none; 1343 s alone with four environments cold, 5 starts
    476 s of it); every run's summary lists what its own starts ran."""
    assert share(base, **TIMEOUT_PARAMS).event_loops() == OVERLAP_LOOPS
