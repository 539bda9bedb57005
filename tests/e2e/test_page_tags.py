"""H8 on the CPU PD harness: pages decode would read that its transfer did not write are
refused by their tags alone, with H3 (page coverage) left out of the build; the same
injected faults (tests/cpu_overlay/site/sgl_faults.py) on upstream are served behind a
200 with output influenced by other requests, which the differential oracle shows.

H4 is left out too: its patch's context holds H3's import line, so it does not
apply without H3. Upstream's side of the truncation fault (decode reads pages
holding another tenant's KV, behind a 200) is
`test_oversized.test_upstream_truncation_with_unequal_limits_reads_other_tenants_kv`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hardened.common.knobs import PAGE_TAGS_FAIL_CLOSED
from sglang_hardened.operations.oracle import Verdict
from sglang_hardened.sandbox.env import overlay_module
from tests.harness import SERVER_RESTART, phase

from .conftest import sandbox_env
from .scenarios import (
    DEPTH,
    FITTING_C,
    FULL_MATRIX,
    HEARTBEAT,
    LEAK_PARAMS,
    OVERSIZED_B,
    observe_probes,
    prompt_of,
    replies,
    shows_nothing_decoded,
    trunc_params,
    wait_pages_idle,
)

pytestmark = pytest.mark.e2e

WITHOUT = ("H3", "H4")
REFUSED = "sglang-hardened H8"
faults = overlay_module("sgl_faults")  # injected page faults, in upstream and hardened builds alike
# One cluster per base, backend and build runs its faults in turn (each fault on one base, to keep
# the starts few). The decode-side faults hit any backend: NIXL gets one of them.
FAULTS = {("0.5.23", "mooncake"): ("drop-last-page", "page-reused-early"), ("0.5.19", "mooncake"): ("stale-page-index",),
          ("0.5.23", "nixl"): ("stale-page-index",)}
FAIL_CLOSED = ("0.5.19", "mooncake")  # its decode fails closed (its one fault is the last)
# Upstream reads what each fault leaves on Mooncake in CI (every fault kind once); on NIXL (the
# same decode-side fault, the same read) in the full matrix.
UPSTREAM_FAULTS = [pair for pair in FAULTS if FULL_MATRIX or pair[1] == "mooncake"]
# 17 one-token pages: over the faults' 16-page floor, and short enough that the one page
# a fault hits moves the tiny model's output (an 80-token probe hides a page or two).
FAULT_PROBE = prompt_of(17)


@pytest.mark.claim("H8", "hardened", params=["0.5.23-16-mooncake"])
# 0.5.19's paged allocator needs Triton (no CPU path) for pages over one token. NIXL writes the
# tags two ways: joined to the chunk's handles (0.5.23) or waited for before the KV (0.5.19-0.5.22).
# 0.5.23 NIXL with 16-token pages runs in the full matrix: CI has 16-token pages on Mooncake,
# 0.5.19's NIXL path here, and 0.5.23's NIXL path in the injected faults below.
@pytest.mark.parametrize("base,page_size,backend", [("0.5.19", 1, "mooncake"), ("0.5.23", 16, "mooncake"),
                                                    *([("0.5.23", 16, "nixl")] if FULL_MATRIX else []),
                                                    ("0.5.19", 1, "nixl")])
def test_h8_refuses_pages_a_truncated_transfer_left_unwritten(start_cluster, base, page_size, backend):
    """Prefill truncates the prompt and sends fewer pages than decode reads: the pages it did
    not send carry no tag of this request's, so decode refuses it; a fitting prompt is served,
    so the tags did travel with the KV."""
    h8_truncation(start_cluster, base, backend, page_size)


def h8_truncation(start_cluster, base: str, backend: str, page_size: int,
                  extra: dict[str, str] | None = None) -> dict[str, Verdict]:
    """The truncation on a hardened build without H3 and H4 (one cluster start); ``extra``
    probes run beside it, their verdicts returned for the caller to judge."""
    cluster = start_cluster(sandbox_env(base, hardened=True, without=WITHOUT), backend=backend,
                            **trunc_params(page_size), **DEPTH)
    idle = cluster.used_tokens()
    with phase(f"scenario truncation {base} {backend} page {page_size} hardened without H3"):
        v = observe_probes(cluster, {"pages_apart": OVERSIZED_B, "control": FITTING_C, **(extra or {})})
    assert all(r.status == 500 and REFUSED in r.body for r in replies(v["pages_apart"])), v["pages_apart"].replies
    assert shows_nothing_decoded(v["pages_apart"]), v["pages_apart"].replies
    assert all(r.status == 200 for r in replies(v["control"])) and not v["control"].leaked
    assert wait_pages_idle(cluster, idle) == idle
    assert "do not carry its tag" in cluster.log_tail("decode", 2000)
    return v


def _fault_cluster(start_cluster, switch: Path, base: str, backend: str, hardened: bool, *env_extra: str,
                   flags: tuple[str, ...] = ()):
    """A cluster that cycles decode's free list, its page faults switched by ``switch`` (empty: none)."""
    switch.write_text("")
    env = sandbox_env(base, hardened=True, without=WITHOUT) if hardened else sandbox_env(base)
    depth = DEPTH["extra_env"] if hardened else ()
    return start_cluster(env, backend=backend, **LEAK_PARAMS, extra_flags=flags,
                         extra_env=(*depth, f"{faults.FILE_ENV}={switch}", *env_extra))


def _hits(cluster, fault: str) -> int:
    """How many transfers the fault hit (its module logs each): zero means its edit did not apply."""
    role = "prefill" if fault == "drop-last-page" else "decode"
    return cluster.log_tail(role, 10**6).count(f"SANDBOX PAGE FAULT {fault}:")


@pytest.mark.parametrize("base,backend", FAULTS)
def test_h8_refuses_injected_faults(start_cluster, tmp_path, base, backend):
    """Each injected fault makes every request read a page its transfer did not write; H8 alone
    refuses each before decoding and no page is lost. The same prompt is served with no fault.
    0.5.19's decode fails closed: after the first mismatch it admits no request, the fault
    switched off or not, until restarted."""
    switch = tmp_path / "fault"
    fail_closed = (base, backend) == FAIL_CLOSED
    cluster = _fault_cluster(start_cluster, switch, base, backend, True,
                             *((f"{PAGE_TAGS_FAIL_CLOSED.name}=1",) if fail_closed else ()))
    idle = cluster.used_tokens()
    assert cluster.generate(FAULT_PROBE).status == 200
    for fault in FAULTS[base, backend]:
        switch.write_text(fault)
        with phase(f"scenario fault {fault} {base} {backend} hardened without H3"):
            got = [cluster.generate(FAULT_PROBE) for _ in range(3)]
        assert all(r.status == 500 and REFUSED in r.body for r in got), (fault, got)
        assert _hits(cluster, fault) >= 3
        assert wait_pages_idle(cluster, idle) == idle
    if fail_closed:
        switch.write_text("")
        closed = [r for r in got[1:] + [cluster.generate(FAULT_PROBE)] if "stopped admitting requests" in r.body]
        assert len(closed) == 3 and all(r.status == 500 for r in closed), got
        assert wait_pages_idle(cluster, idle) == idle


@pytest.mark.parametrize("base,backend", UPSTREAM_FAULTS)
def test_upstream_output_depends_on_other_requests_under_injected_faults(start_cluster, tmp_path, base, backend):
    """The same faults on upstream: every request is answered 200, and the probe's output
    changes with the history of other tenants' requests before it (the differential oracle:
    a correct server's greedy output does not). No page is lost."""
    switch = tmp_path / "fault"
    cluster = _fault_cluster(start_cluster, switch, base, backend, hardened=False)
    idle = cluster.used_tokens()
    for fault in FAULTS[base, backend]:
        switch.write_text(fault)
        with phase(f"scenario fault {fault} {base} {backend} upstream"):
            v = observe_probes(cluster, {"probe": FAULT_PROBE})["probe"]
        assert all(r.status == 200 for r in replies(v)), (fault, v.replies)
        assert v.leaked, (fault, v.replies)
        assert _hits(cluster, fault) >= 4
        assert wait_pages_idle(cluster, idle) == idle


# Upstream's per-transfer KV checksum (sgl-project/sglang#39500, from 0.5.21), which `launch`
# turns on from 0.5.23 (H10): prefill digests the pages it computed, decode the pages it holds,
# once, as the request enters its first batch (`_verify_kv_checksums`); a CPU stand-in computes
# the same Adler-32 here (tests/cpu_overlay/site/sgl_cpu_checksum.py).
CHECKSUM = "--disaggregation-enable-kv-checksum"
CHECKSUM_REFUSAL = "KV checksum mismatch"


def test_kv_checksum_refuses_each_read_fault_and_a_prefill_without_it_turns_it_off(start_cluster, tmp_path):
    """On upstream 0.5.23 with the checksum on, each read fault H8 refuses is refused too
    (500, nothing decoded, no answer that depends on other tenants), where the same faults
    without it are served 200 with one (the test above). A prefill started without the flag
    writes no digest, and decode then admits its transfers unverified: the same fault is served
    200 again, with output that depends on other tenants. So the checksum holds only while every
    prefill runs it (preflight reads the setting back from each server, docs/hardening.md H10)."""
    switch = tmp_path / "fault"
    cluster = _fault_cluster(start_cluster, switch, "0.5.23", "mooncake", False, *HEARTBEAT, flags=(CHECKSUM,))
    idle = cluster.used_tokens()
    assert cluster.generate(FAULT_PROBE).status == 200  # digests agree on a transfer with no fault
    for fault in ("drop-last-page", "stale-page-index", "page-reused-early"):
        switch.write_text(fault)
        with phase(f"scenario fault {fault} 0.5.23 mooncake upstream with the KV checksum"):
            v = observe_probes(cluster, {"probe": FAULT_PROBE})["probe"]
        # a page whose stale bytes equal what the transfer would have written (the probe's own
        # earlier KV) digests the same, and is read correctly: no refusal needed, none leaked
        refused = [r for r in replies(v) if r.status == 500 and CHECKSUM_REFUSAL in r.body]
        assert refused and all(r in refused or r.status == 200 for r in replies(v)), (fault, v.replies)
        assert not v.leaked, (fault, v.replies)
        assert _hits(cluster, fault) >= 4
        assert wait_pages_idle(cluster, idle) == idle
    switch.write_text("")
    prefill = cluster.procs["prefill"]
    prefill.cmd = [arg for arg in prefill.cmd if arg != CHECKSUM]
    with phase(f"{SERVER_RESTART} prefill 0.5.23 without the KV checksum"):
        cluster.restart("prefill")
    switch.write_text("drop-last-page")
    with phase("scenario fault drop-last-page 0.5.23 mooncake upstream, prefill without the KV checksum"):
        v = observe_probes(cluster, {"probe": FAULT_PROBE})["probe"]
    assert all(r.status == 200 for r in replies(v)) and v.leaked, v.replies
