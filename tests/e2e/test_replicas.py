"""PD with several servers per role (2 prefills x 2 decodes), as production runs it behind a
gateway that pairs a prefill and a decode per request: the hardening's per-peer state, which
a single pair never exercises, on real servers.

Each request here is sent to the pair it names, as a balancer that chose that pair sends it
(``observe_pair``), so which prefill and which decode served it is known.

Tier and cost (2026-12-06, `scripts/test tests/e2e/test_replicas.py` on the shared 2-core
machine, load average 15-20; a 2x2 start loads four servers, about twice a pair's):
- gate: the H7 pair, two 2x2 starts (upstream and hardened 0.5.23): 224 s at load 20 (starts of
  66 s and 107 s), 393 s at load 40 (88 s and 117 s);
- full: a hardened 2x2 fault cluster (one start) on which a prefill and a decode are killed and
  replaced (two restarts; a third when both decodes' writes would share a transfer queue, one run
  in 16), every balancer's smoke and the oracle: 618 s at load 35 (start 145 s, restarts 153 s and
  65 s). Upstream's (the same again) runs in the full matrix only: it holds these faults too;
- full: the incident across instances, upstream and hardened 0.5.19 on 2x2 (two starts, 100 s
  and 147 s), 485 s.
"""

from __future__ import annotations

import json
import re
import signal
import uuid
from pathlib import Path

import pytest

from sglang_hardened.operations.oracle import generate
from sglang_hardened.sandbox.cluster import LBS
from sglang_hardened.sandbox.instruments import SLOW_S
from sglang_hardened.sandbox.ledger import Ledger, writer

from .conftest import restart, sandbox_env
from .inflight import InFlight, send_all_mid_transfer
from .scenarios import (DEPTH, FITTING_C, FULL_MATRIX, LEAK_PARAMS, METRICS_FLAGS, OVERSIZED_B, SLOW_PROMPT,
                        hardened_metric, observe_pair, observe_probes, prompt_of, shows_nothing_decoded, tenants_apart,
                        via_pair, wait_pages_idle)
from .scenarios import replies as replies_of
from .test_fault_matrix import LOST_PEER_S, PARAMS, RELEASE_TIMEOUT_S, Build, FaultCluster, _report, on, start_fault_cluster

pytestmark = pytest.mark.e2e

# prefill-1 is the smaller one: a 600-token pool, so a 600-token context and an input limit of
# 594, where prefill's and both decodes' is 1018. Each decode must judge each prefill on its own.
# Ready without a request through mini-lb: on hardened one it sent to prefill-1 would be refused,
# and answered only once prefill-1's bootstrap wait (the 15 s timeout) ran out.
UNEQUAL_PREFILLS = dict(prefills=2, decodes=2, prefill_limits=(1024, 600), context_length=1024,
                        waiting_timeout_s=15, extra_flags=METRICS_FLAGS, probe_transfer=False)
SMALL_LIMIT = 594
SHORT = prompt_of(17)
BETWEEN = prompt_of(700)  # fits prefill and both decodes, not prefill-1


@pytest.mark.claim("H7", "upstream")
def test_upstream_decodes_admit_requests_for_the_smaller_prefill(start_cluster):
    """Upstream 0.5.23 serves a PD deployment whose prefills admit different input lengths: both
    decodes take requests for the smaller prefill, and a prompt that fits the decode and not that
    prefill is admitted there: the prefill refuses it at once, and the decode holds it until its
    waiting timeout has run, then fails it (500)."""
    cluster = start_cluster(sandbox_env("0.5.23"), **UNEQUAL_PREFILLS)
    for prefill in cluster.servers("prefill"):
        for decode in cluster.servers("decode"):
            assert observe_pair(cluster, SHORT, prefill, decode)[1].status == 200, (prefill, decode)
    at_prefill, at_decode = observe_pair(cluster, BETWEEN, "prefill-1", "decode-1")
    print(f"\nupstream, {len(BETWEEN.split())} words via prefill-1 and decode-1: prefill {at_prefill.status} "
          f"after {at_prefill.seconds:.1f} s, decode {at_decode.status} after {at_decode.seconds:.1f} s")
    assert at_prefill.status == 400, at_prefill
    assert at_decode.status == 500 and at_decode.seconds >= cluster.params.waiting_timeout_s - 1, at_decode
    assert observe_pair(cluster, BETWEEN, "prefill", "decode-1")[1].status == 200


@pytest.mark.claim("H7", "hardened")
def test_hardened_decodes_refuse_only_the_smaller_prefill_and_name_it(start_cluster):
    """Each hardened decode refuses the requests for the prefill whose limit is below its own,
    names that prefill (its bootstrap address) once, and serves the other prefill's, long
    prompts included: H7's judgement is per prefill, which one pair cannot show (a decode that
    refused every prefill once one fell short would pass there)."""
    cluster = start_cluster(sandbox_env("0.5.23", hardened=True), **UNEQUAL_PREFILLS)
    small = f"127.0.0.1:{cluster.bootstrap_ports['prefill-1']}"  # named once by each decode, and no other
    for decode in cluster.servers("decode"):
        assert observe_pair(cluster, BETWEEN, "prefill", decode)[1].status == 200, decode
        refused = observe_pair(cluster, SHORT, "prefill-1", decode)[1]
        assert refused.status >= 500, (decode, refused)
        log = cluster.log_tail(decode, 4000)
        said = re.findall(r"sglang-hardened H7: this decode accepts inputs up to \d+ tokens but the prefill at "
                          r"(\S+) only up to (\d+)", log)
        assert said == [(small, str(SMALL_LIMIT))], (decode, said)
        assert hardened_metric(cluster, decode, "requests_refused_total", id="H7", reason="limit_below_decode") >= 1
        assert observe_pair(cluster, SHORT, "prefill", decode)[1].status == 200, f"{decode} stopped serving"


# --- the incident across instances (full tier) ------------------------------------------------

@pytest.mark.parametrize("hardened", [False, True], ids=["upstream", "hardened"])
def test_0519_incident_across_instances(start_cluster, tmp_path, hardened):
    """The incident where prefills and decodes are several: tenant B's over-pool prompt, served
    by prefill-1 and decode-1, after tenant A's history through prefill and decode-1. Upstream
    0.5.19 answers B 200 with an output that changes with A's prompt: decode-1 decodes over
    pages the other prefill filled for A. Hardened 0.5.19 (H7's start-up refusal overridden, as
    the layers behind it are under test) answers B with a refusal that carries nothing decoded;
    on both, the fitting control is history-free, no page is freed under a write (the page
    ledger), and every server's pages come back."""
    cluster = start_cluster(sandbox_env("0.5.19", hardened=hardened), **LEAK_PARAMS, prefills=2, decodes=2,
                            extra_env=(*(DEPTH["extra_env"] if hardened else ()), f"{writer.DIR_ENV}={tmp_path}"))
    idle = cluster.used_tokens()
    v = observe_probes(cluster, {"oversized": OVERSIZED_B, "control": FITTING_C}, tenants_apart(cluster))
    b = v["oversized"]
    print({label: b.outputs(label) for label in b.replies})
    assert all(r.status == 200 for r in replies_of(v["control"])) and not v["control"].leaked, v["control"].replies
    if hardened:
        assert shows_nothing_decoded(b), b.replies
    else:
        assert all(r.status == 200 for r in replies_of(b)), b.replies
        assert b.leaked and all(a1 != a2 for a1, a2 in zip(b.outputs("A1"), b.outputs("A2"))), b.replies
    assert wait_pages_idle(cluster, idle) == idle, "pages leaked"
    assert not Ledger(tmp_path).unsafe_frees()


# --- faults aimed at one server while the others serve (full tier) --------------------------

# Sixteen transfer queues per prefill (upstream's default is four): a prefill shards its writes by
# the decode's session port, so two decodes share a queue, and their writes run one after the
# other, less often (a restart of 70 s on this machine); `apart` makes sure they do not.
QUEUES = 16
REPLICA_ENV = (f"SGLANG_DISAGGREGATION_QUEUE_SIZE={QUEUES}", f"SGLANG_DISAGGREGATION_THREAD_POOL_SIZE={QUEUES}")
# Upstream 0.5.23 holds these faults too (2026-12-06: both passed on it): the full matrix runs it.
REPLICA_BUILDS = [Build("0.5.23", "mooncake", hardened) for hardened in (False, True) if hardened or FULL_MATRIX]
SESSION_PORT = re.compile(r"Transfer Engine RPC using P2P handshake, listening on [\d.]+:(\d+)")


@pytest.fixture(scope="module")
def fc(request, tmp_path_factory):
    """A 2x2 fault cluster (the fault matrix's instruments and settings) of the test's build."""
    fault_cluster = start_fault_cluster(request.param, tmp_path_factory.mktemp("instruments"),
                                        dict(PARAMS, prefills=2, decodes=2), REPLICA_ENV)
    yield fault_cluster
    fault_cluster.cluster.stop()


def apart(fc: FaultCluster) -> None:
    """Both decodes on different transfer queues of a prefill (upstream shards by the decode's
    Mooncake session port): restart decode-1 (a fresh port) while they share one."""
    def queue(decode: str) -> int:
        return int(SESSION_PORT.findall(Path(fc.cluster.procs[decode].log).read_text(errors="replace"))[-1]) % QUEUES

    for _ in range(3):
        if queue("decode") != queue("decode-1"):
            return
        restart(fc.cluster, "decode-1", fc.env)
    raise AssertionError("decode and decode-1 kept sharing a transfer queue")


def in_flight_to_both_decodes(fc: FaultCluster, prefill: str = "prefill") -> list[InFlight]:
    """One request from ``prefill`` to each decode, both caught mid-write at once."""
    apart(fc)
    reqs = send_all_mid_transfer(fc.cluster, fc.ledger_dir, [(uuid.uuid4().hex, prefill, decode)
                                                              for decode in fc.cluster.servers("decode")],
                                 fc.slow_switch)
    for req in reqs:
        req.read_answers(120)
    return reqs


@on(REPLICA_BUILDS)
def test_prefill_killed_with_writes_to_two_decodes_in_flight(fc):
    """SIGKILL a prefill while its writes into both decodes run: each decode fails its own
    request within its heartbeat, no decode page goes back before the writer is dead, the
    other prefill serves both decodes meanwhile, and the prefill replaced in place serves
    again with every server's pages back. One pair has one write and one decode to tell."""
    reqs = in_flight_to_both_decodes(fc)
    killed_at = fc.signal("prefill", signal.SIGKILL)
    answers = [req.answer("decode", timeout_s=LOST_PEER_S + 10) for req in reqs]
    meanwhile = [observe_pair(fc.cluster, SHORT, "prefill-1", decode)[1] for decode in fc.cluster.servers("decode")]
    restart(fc.cluster, "prefill", fc.env)
    for req in reqs:
        _report(fc, "prefill killed, writes to two decodes", req)
    assert all(a.status == 500 and a.seconds < LOST_PEER_S for a in answers), answers
    assert all(r.status == 200 for r in meanwhile), meanwhile
    assert wait_pages_idle(fc.cluster, fc.idle, timeout_s=RELEASE_TIMEOUT_S + 30) == fc.idle, "pages leaked"
    unsafe = [u for req in reqs for u in fc.unsafe(req.room, killed_at)]
    assert not unsafe, "\n".join(map(str, unsafe[:5]))
    assert all(observe_pair(fc.cluster, SHORT, "prefill", d)[1].status == 200 for d in fc.cluster.servers("decode"))


@on(REPLICA_BUILDS)
def test_decode_killed_and_replaced_while_the_other_serves(fc):
    """SIGKILL decode-1 while one prefill writes into it and into decode: decode's request is
    served whole (the quiet cluster's output), the write into the dead decode ends in an error
    on prefill, no prefill page goes back while a write reads it, the other prefill keeps
    serving decode, and decode-1, replaced in place, serves both prefills again."""
    quiet = observe_pair(fc.cluster, SLOW_PROMPT, "prefill", "decode")[1]
    kept, lost = in_flight_to_both_decodes(fc)
    fc.signal("decode-1", signal.SIGKILL)
    served = kept.answer("decode", timeout_s=SLOW_S + 60)
    failed = lost.answer("prefill", timeout_s=LOST_PEER_S + SLOW_S + 10)
    meanwhile = observe_pair(fc.cluster, SHORT, "prefill-1", "decode")[1]
    restart(fc.cluster, "decode-1", fc.env)
    _report(fc, "decode-1 killed (prefill's answer)", lost, role="prefill")
    assert served.status == 200 and json.loads(served.body)["output_ids"] == list(quiet.output_ids), (served, quiet)
    assert failed.status != 200, failed
    assert meanwhile.status == 200, meanwhile
    assert wait_pages_idle(fc.cluster, fc.idle) == fc.idle, "pages leaked"
    unsafe = [u for u in Ledger(fc.ledger_dir).unsafe_source_frees() if u.room in (kept.room, lost.room)]
    assert not unsafe + fc.unsafe(kept.room), "\n".join(map(str, (unsafe + fc.unsafe(kept.room))[:5]))
    assert all(observe_pair(fc.cluster, SHORT, p, "decode-1")[1].status == 200 for p in fc.cluster.servers("prefill"))


@on([b for b in REPLICA_BUILDS if b.hardened])
def test_every_balancer_spreads_requests_over_every_server(fc):
    """mini-lb, smg and `sglang-hardened lb`, each started with every server, send requests to
    both prefills and both decodes (a smoke: which pair each chooses is its own policy). The
    prompts differ from their first word: smg's default policy (cache-aware) sends prompts
    sharing a prefix to the server that holds it."""
    def served() -> dict[str, int]:
        return {n: Path(p.log).read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')
                for n, p in fc.cluster.procs.items() if not n.startswith("lb")}

    for kind in LBS:
        url = fc.cluster.lb_url if kind == fc.cluster.params.lb else fc.cluster.add_lb(kind, fc.env)
        before = served()
        replies = [generate(url, f"{i} tenant {i} asks about {i} keys", max_new_tokens=2, timeout=120)
                   for i in range(12)]
        spread = {n: count - before[n] for n, count in served().items()}
        print(f"\n{kind}: {spread}")
        assert all(r.status == 200 for r in replies), (kind, replies)
        assert all(spread.values()), (kind, spread)


@on(REPLICA_BUILDS)
def test_next_requests_read_only_their_own_pages(fc):
    """The differential oracle after the faults above, through the replaced prefill and the
    replaced decode-1."""
    verdict = observe_probes(fc.cluster, {"control": FITTING_C}, via_pair(fc.cluster, "prefill", "decode-1"))["control"]
    assert all(r.status == 200 for r in replies_of(verdict)), verdict
    assert not verdict.leaked, verdict
