"""Every claim across ranks (issue 26): PD clusters whose roles run two tensor-parallel ranks
(gloo on CPU, one core per rank), or unequal TP sizes, upstream and hardened builds of the
same bases, on real Mooncake and NIXL. Per cluster, in order: the incident (an oversized
prompt in front of other tenants' history), faults that hit one rank only (a page its
transfer left out, a transfer that fails part-way, a rank killed mid-write), and the
differential oracle after them. The page ledger judges every page free across every rank's
process: decode's ranks allocate in step, so a page number is the same page on each.

Unequal sizes on MHA move KV by head slices (upstream's ``send_kvcache_slice``): each prefill
rank writes its heads' slice of a decode page and, hardened, those heads' tag slots, so a page
is admitted only when every slice landed. The ledger records the sliced sends as it does the
whole-page ones; the lost page runs there too where two prefill ranks write one decode page
(prefill TP 2, decode 1); the rest of the one-rank faults run on equal sizes.

DP attention (TP 2 split into two DP groups on both roles; the full matrix only) runs the sandbox's
Qwen3 (upstream's Llama splits its embedding and heads over the whole TP group, which DP attention
cannot run): each request lives on one DP rank, whose pages the other rank never sees, so the
one-rank faults there are the single-rank matrix's; here, the incident, the truncation and the
differential oracle.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_hardened.runtime.page_tags.seams import OTHER_RANK
from tests.harness import phase

from .conftest import sandbox_env
from .scenarios import (DEPTH, FITTING_C, FULL_MATRIX, LEAK_PARAMS, OVERSIZED_B, TRUNC_PARAMS, observe_leak,
                        observe_probes, prompt_of, replies, shows_nothing_decoded, wait_pages_idle)
from .test_fault_matrix import (LOST_PEER_S, RELEASE_TIMEOUT_S, Build, FaultCluster, _report, _serves_within,
                                check_fails_part_way, on, restart, start_fault_cluster)

pytestmark = pytest.mark.e2e

RANKS = [(2, 2), (2, 1), (1, 2)]
# CI: one TP configuration per base, both builds (the full matrix: every size, base and backend)
CI_RANKS = [("0.5.23", "mooncake", 2, 2), ("0.5.19", "mooncake", 2, 1)]
# NIXL between unequal TP sizes does not run on CPU: upstream refuses heterogeneous TP toward
# host memory (NotImplementedError "NIXL heterogeneous-TP direct-to-host KV transfer is not
# implemented safely yet", 0.5.19 and 0.5.23), and this harness's KV pools are host memory.
RANK_BUILDS = [Build(base, backend, hardened, tp=tp, decode_tp=dtp)
               for base in ("0.5.19", "0.5.23") for backend in ("mooncake", "nixl") for tp, dtp in RANKS
               for hardened in (False, True)
               if (FULL_MATRIX or (base, backend, tp, dtp) in CI_RANKS) and (backend == "mooncake" or tp == dtp)] + \
    [Build(base, backend, hardened, tp=2, decode_tp=2, dp=2) for base in ("0.5.19", "0.5.23")
     for backend in ("mooncake", "nixl") for hardened in (False, True) if FULL_MATRIX]
EQUAL = [b for b in RANK_BUILDS if not b.sliced and b.dp == 1]
# Where one prefill rank's page write can be lost alone: equal sizes, and Mooncake's head-sliced
# sender from two prefill ranks (each writes its heads' slice of every decode page; CI: hardened,
# about 1 s; upstream's 200 there, 43 s, in the full matrix).
ONE_RANK_WRITES = EQUAL + [b for b in RANK_BUILDS if b.sliced and b.tp > 1 and (b.hardened or FULL_MATRIX)]
H8_REFUSED = "sglang-hardened H8"
FAULT_PROBE = prompt_of(17)  # over the faults' 16-page floor; one page moves the tiny model's output
OTHER_RANK_SAYS = OTHER_RANK.split("{room}: ")[1][:40]
# The truncation scenario needs a cluster of its own (unequal limits, 16-token pages): CI runs
# hardened 0.5.23 TP 2/2, the full matrix every hardened layout. Upstream's read is shown with one
# rank (test_oversized.py); on 0.5.19 TP 2/2 (Mooncake, NIXL) every answer was 200 but the
# differential oracle saw no output move with the tenant before, so it is not claimed here.
TRUNC_BUILDS = ([b for b in RANK_BUILDS if b.hardened] if FULL_MATRIX
                else [Build("0.5.23", "mooncake", True, tp=2, decode_tp=2)])


@pytest.fixture(scope="module")
def fc(request, tmp_path_factory):
    """The incident's cluster (prefill's pool below the context length; H7's refusal of it
    overridden on hardened builds, whose other checks are under test) with the fault
    instruments, of the test's build; stopped before the next build's starts."""
    build: Build = request.param
    fault_cluster = start_fault_cluster(build, tmp_path_factory.mktemp("instruments"), LEAK_PARAMS,
                                        DEPTH["extra_env"] if build.hardened else ())
    yield fault_cluster
    fault_cluster.cluster.stop()


@pytest.mark.parametrize("build", TRUNC_BUILDS, ids=lambda b: b.id)
def test_truncation_with_unequal_limits_across_ranks(start_cluster, build):
    """Prefill truncates the prompt to its limit and decode keeps it whole: hardened refuses it
    on every rank with nothing decoded, and serves the control."""
    cluster = start_cluster(sandbox_env(build.base, hardened=True), build.model, backend=build.backend, **TRUNC_PARAMS,
                            tp=build.tp, decode_tp=build.decode_tp, dp=build.dp, **DEPTH)
    idle = cluster.used_tokens()
    with phase(f"scenario truncation {build.id}"):
        v = observe_probes(cluster, {"pages_apart": OVERSIZED_B, "control": FITTING_C})
    apart, control = v["pages_apart"], v["control"]
    assert shows_nothing_decoded(apart), apart.replies
    assert all(r.status == 200 for r in replies(control)) and not control.leaked, control.replies
    assert wait_pages_idle(cluster, idle) == idle, "pages leaked"


@on([b for b in RANK_BUILDS if b.hardened or b.base == "0.5.19"])
def test_the_incident_across_ranks(fc):
    """An oversized prompt after other tenants' history. Upstream 0.5.19 answers 200 from pages
    its transfer never wrote, on every rank layout; hardened refuses it with nothing decoded.
    (Upstream 0.5.20+ refuses it too, after decode's waiting timeout: test_oversized.py.)
    Between unequal TP sizes a hardened decode serves the control: the head slices carry their
    heads' tag slots (before, it refused every request there, naming both sizes)."""
    with phase(f"scenario leak {fc.name}"):
        obs = observe_leak(fc.cluster)
    b, control = obs.oversized, obs.control
    print({label: b.outputs(label) for label in b.replies})
    if not fc.hardened:
        assert all(r.status == 200 for r in replies(b)) and b.leaked, b.replies
        assert all(r.status == 200 for r in replies(control)) and not control.leaked, control.replies
    else:
        assert shows_nothing_decoded(b), b.replies
        assert all(r.status == 200 for r in replies(control)) and not control.leaked, control.replies
    assert wait_pages_idle(fc.cluster, fc.idle) == fc.idle, "pages leaked"


# The read fault of each backend that can hit one rank: Mooncake's sender leaves a page out (prefill's
# rank); NIXL's gets a decode-side one, the same on any backend (a stale page in one rank's page table).
READ_FAULTS = {"mooncake": ("drop-last-page", "prefill"), "nixl": ("stale-page-index", "decode")}


@on(ONE_RANK_WRITES)
@pytest.mark.parametrize("rank", [1, 0] if FULL_MATRIX else [1])  # CI: the rank whose peer must learn of it
def test_a_page_one_rank_did_not_write(fc, rank):
    """One rank's request reads a page its transfer did not write (the other ranks' are whole).
    Hardened: every rank aborts the request (H8's verdict is shared: before, the clean rank
    decoded it while the other aborted, and decode answered no one again), and the next request
    is served. Upstream: 200, with output that depends on other tenants. Between unequal sizes
    (prefill TP 2, decode 1) one prefill rank's head slice of the page is lost and the other's
    lands: decode's one rank refuses it on that slice's tag slots."""
    fault, role = READ_FAULTS[fc.build.backend]
    fc.fault_file.write_text(f"{fault}@{rank}")
    try:
        with phase(f"scenario fault {fault}@{rank} {fc.name}"):
            if fc.hardened:
                got = [fc.cluster.generate(FAULT_PROBE, timeout=120) for _ in range(2)]
            else:
                v = observe_probes(fc.cluster, {"probe": FAULT_PROBE})["probe"]
    finally:
        fc.fault_file.write_text("")
    hits = [line for line in fc.cluster.log_tail(role, 10**6).splitlines()
            if f"SANDBOX PAGE FAULT {fault}:" in line and line.endswith(f"(rank {rank})")]
    if fc.hardened:
        assert all(r.status == 500 and H8_REFUSED in r.body for r in got), got
        says_other = [OTHER_RANK_SAYS in r.body for r in got]  # the client reads rank 0's message
        assert says_other == [rank != 0 and not fc.build.sliced] * len(got), got
        assert fc.cluster.generate(FITTING_C, timeout=120).status == 200
        assert len(hits) >= 2
    else:
        assert all(r.status == 200 for r in replies(v)) and v.leaked, v.replies
        assert len(hits) >= 4
    assert wait_pages_idle(fc.cluster, fc.idle) == fc.idle, "pages leaked"


@on(EQUAL)
def test_one_ranks_transfer_fails_part_way(fc):
    """Rank 1's send writes half its pages and fails; rank 0's completes. Prefill fails the
    room, the client gets a 500 (not a 200 over half-written pages, not decode's waiting
    timeout), no page goes back under a live write on any rank, and decode serves again
    (upstream 0.5.19 blacklists the session: it serves no more until restarted)."""
    # upstream before 0.5.23 frees decode's pages at the failure, which rank 0's write may still
    # reach (the full matrix saw 0.5.19 Mooncake do it): its pages are reported, not judged
    check_fails_part_way(fc, "fail-part-way@1", "rank 1's transfer failed part-way",
                         judge_pages=fc.hardened or Version(fc.build.base) >= Version("0.5.23"))


def scheduler_pid(fc: FaultCluster, role: str, rank: int) -> int:
    """The pid of ``role``'s scheduler for TP rank ``rank`` (SGLang titles it ``scheduler_TP<rank>``)."""
    group = fc.cluster.procs[role].pid
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == group and \
                    f"scheduler_TP{rank}".encode() in (d / "cmdline").read_bytes():
                return int(d.name)
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no {role} scheduler for TP rank {rank} in process group {group}")


@on(EQUAL)  # a killed prefill rank takes all of prefill down whatever the sizes; a lost slice is tested above
def test_one_rank_killed_mid_transfer(fc):
    """SIGKILL prefill's rank 1 scheduler mid-write: SGLang takes the whole prefill down;
    decode fails the request with an error (no 200 for KV nobody holds), no page goes back
    under a live write, and the prefill restarted in place serves again."""
    fc.kill_tests_apply()
    req = fc.catch_mid_transfer()
    req.read_answers(120)
    os.kill(scheduler_pid(fc, "prefill", 1), signal.SIGKILL)
    killed_at = time.monotonic()
    ans = req.answer("decode", timeout_s=LOST_PEER_S + RELEASE_TIMEOUT_S + 30)
    restart(fc.cluster, "prefill", fc.env)
    assert wait_pages_idle(fc.cluster, fc.idle, timeout_s=RELEASE_TIMEOUT_S + 30) == fc.idle, "pages leaked"
    unsafe = fc.unsafe(req.room, killed_at)
    _report(fc, "prefill rank 1 killed", req)
    assert ans.status is not None and ans.status >= 400, f"decode must answer an error in time, not {ans}"
    assert not unsafe, "\n".join(map(str, unsafe[:5]))
    assert _serves_within(fc.cluster, 30), "the cluster never served again"


@on(RANK_BUILDS)
def test_next_requests_read_only_their_own_pages(fc):
    """The differential oracle after every fault above (and a restarted server)."""
    verdict = observe_probes(fc.cluster, {"control": FITTING_C})["control"]
    assert all(r.status == 200 for r in replies(verdict)) and not verdict.leaked, verdict.replies
