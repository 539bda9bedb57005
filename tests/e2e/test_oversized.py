"""Oversized and boundary-length prompts on hardened builds (H1 H2 H3 H4), against upstream.

Every hardened cluster here overrides H7 (which refuses these configurations
at start-up), to prove the layers behind it. After each scenario both roles
must hold exactly the KV tokens they held before it (no page leaked).
"""

from __future__ import annotations

import json
import time

import pytest

from sglang_hardened.operations.oracle import Verdict, generate
from sglang_hardened.sandbox.env import SandboxError
from sglang_hardened.sandbox.ledger import Ledger, writer
from tests.harness import phase

from .conftest import record_timing, sandbox_env
from .scenarios import (
    FULL_MATRIX,
    AT_LIMIT,
    before_decode_gives_up,
    BOUNDARY_PARAMS,
    CHUNKED,
    DEPTH,
    FITTING_C,
    LEAK_PARAMS,
    METRICS_FLAGS,
    OVER_LIMIT,
    OVERSIZED_B,
    SAME_PAGE,
    SAME_PAGE_TOKENS,
    TIMEOUT_PARAMS,
    TRUNC_PREFILL_TOKENS,
    core,
    edge,
    prompt_of,
    hardened_metric,
    hardened_samples,
    upstream_only,
    observe_oversized_via_lb,
    observe_pair,
    observe_probes,
    replies,
    shows_nothing_decoded,
    tenants_apart,
    trunc_params,
    wait_pages_idle,
)

pytestmark = pytest.mark.e2e

PREFILL_LIMIT_MESSAGE = "exceeds the maximum allowed length (250 tokens)"
WRONG_TYPE = {"sampling_params": {"temperature": "hot", "max_new_tokens": 4}}  # H12
NULL_N = {"sampling_params": {"n": None}}  # H12: 0.5.22's schema gate lets null through
H1_REFUSED = {"id": "H1", "role": "prefill", "reason": "input_too_long"}
PAST_CONTEXT = prompt_of(1030)  # past BOUNDARY_PARAMS' 1024-token context: the tokenizer refuses it
CONTEXT_MESSAGE = "is longer than the model's context length (1024 tokens)"


@pytest.mark.claim("H4", "hardened", params=["0.5.23-mooncake"])
@pytest.mark.parametrize("base,backend", core())
def test_hardened_oversized_and_boundary_prompts(start_cluster, base, backend):
    """H1/H4: an over-limit prompt gets prefill's 400 at once through mini-lb, from prefill's
    own message; the longest accepted prompt and a chunked one are served and history-free.
    H12: a sampling parameter of the wrong type gets a 400 naming it (0.5.22's schema gate for
    "hot" on 0.5.22+, H12 before it and for null). A prompt past the context gets the
    tokenizer's 400, which each role counts (H1 ``over_context``)."""
    cluster = start_cluster(sandbox_env(base, hardened=True), backend=backend, **BOUNDARY_PARAMS, **DEPTH,
                            extra_flags=METRICS_FLAGS)
    idle = cluster.used_tokens()
    # served at 0 before the first refusal, so an alert on its increase sees that first one
    assert [s.value for s in hardened_samples(cluster, "prefill")
            if s.name == "sglang_hardened_requests_refused_total" and s.labels == H1_REFUSED] == [0]
    with phase(f"scenario boundaries {base} hardened {backend}"):
        v = observe_probes(cluster, {"oversized": OVERSIZED_B, "over_limit": OVER_LIMIT,
                                     "at_limit": AT_LIMIT, "chunked": CHUNKED, "control": FITTING_C})
        malformed = [generate(cluster.lb_url, FITTING_C, extra=body, timeout=60) for body in (WRONG_TYPE, NULL_N)]
        past_context = [generate(cluster.lb_url, PAST_CONTEXT, timeout=60) for _ in range(2)]
    # H12 names the field; 0.5.22's schema gate, which answers first there, the value and its type
    assert all(r.status == 400 for r in malformed) and "hot" in malformed[0].body, malformed
    assert "H12" in malformed[1].body and "n=None" in malformed[1].body, malformed[1]  # past 0.5.22's gate too
    # the tokenizer's own refusal, before any scheduler: counted on each role mini-lb sent it to
    assert all(r.status == 400 and CONTEXT_MESSAGE in r.body for r in past_context), past_context
    for name in ("oversized", "over_limit"):
        for r in replies(v[name]):
            record_timing(f"{name} via mini-lb", base, backend, "hardened", r)
            assert r.status == 400 and PREFILL_LIMIT_MESSAGE in r.body, (name, r)
            assert before_decode_gives_up(cluster, r), (name, r.seconds)
    for name, tokens in (("at_limit", 249), ("chunked", 201), ("control", 81)):
        assert all(r.status == 200 and json.loads(r.body)["meta_info"]["prompt_tokens"] == tokens for r in replies(v[name])), v[name].replies
        assert not v[name].leaked, (name, v[name].replies)
    assert wait_pages_idle(cluster, idle) == idle
    # the metrics: prefill refused the over-limit prompts at admission (H1: the incident's over-pool
    # prompt each time), decode ended them on H4's word (read from the outcome route), and
    # both roles counted H12's refusals
    refused = len(replies(v["oversized"])) + len(replies(v["over_limit"]))
    assert hardened_metric(cluster, "prefill", "requests_refused_total", id="H1", reason="input_too_long") == refused
    assert hardened_metric(cluster, "decode", "requests_refused_total", id="H4", reason="prefill_ended") >= 1
    assert hardened_metric(cluster, "decode", "outcome_polls_total", result="ok") >= 1
    assert all(hardened_metric(cluster, role, "requests_refused_total", id="H12") >= 1 for role in ("prefill", "decode"))
    assert all(hardened_metric(cluster, role, "requests_refused_total", id="H1", reason="over_context")
               == len(past_context) for role in ("prefill", "decode"))


@pytest.mark.claim("H3", "upstream", params=["0.5.23-mooncake"])
@pytest.mark.claim("H8", "upstream", params=["0.5.23-mooncake"])
@pytest.mark.parametrize("base,backend", upstream_only([("0.5.23", "mooncake")]))
def test_upstream_truncation_with_unequal_limits_reads_other_tenants_kv(start_cluster, base, backend, tmp_path):
    """H3's bug on every base: prefill truncates to its limit (506 tokens), decode keeps the
    whole prompt and decodes over KV no transfer wrote for it, behind a 200. Pages apart, the
    answers differ with the tenant before; in one page (509 tokens) three slots of a page sent
    whole hold KV prefill never computed for the request (an earlier request's, or never
    written), too few for the tiny model's answer to move, so the page ledger shows it: which
    prefill slot each position decode attends to came from."""
    upstream_truncation(start_cluster, base, backend, tmp_path)


def upstream_truncation(start_cluster, base: str, backend: str, ledger_dir, page_size: int = 16,
                        extra: dict[str, str] | None = None, model: str = "tiny",
                        layout: dict | None = None, pair: tuple[str, str] | None = None) -> dict[str, Verdict]:
    """The upstream truncation scenario at ``page_size`` on ``model`` (one cluster start, ranks as
    ``layout`` says: tp, dp, prefill_pp, or other cluster parameters); ``extra`` probes run beside it, all answered 200, their
    verdicts returned for the caller to judge. ``pair`` (a prefill's and a decode's name) sends
    the probes there, and tenant A's history through another prefill (``tenants_apart``),
    which then serves the same prompts whole; else all goes through the cluster's balancer."""
    cluster = start_cluster(sandbox_env(base), model, backend=backend, **(trunc_params(page_size) | (layout or {})),
                            extra_env=(f"{writer.DIR_ENV}={ledger_dir}",))
    with phase(f"scenario truncation {base} upstream {backend} page {page_size}"):
        v = observe_probes(cluster, {"pages_apart": OVERSIZED_B, "same_page": SAME_PAGE, **(extra or {})},
                           pair and tenants_apart(cluster, *pair))
    print({name: {label: v[name].outputs(label) for label in v[name].replies} for name in v})
    assert all(r.status == 200 for name in v for r in replies(v[name]))
    assert v["pages_apart"].leaked
    same_page = unowned_reads(ledger_dir, SAME_PAGE_TOKENS)
    past_prefill = list(range(TRUNC_PREFILL_TOKENS, SAME_PAGE_TOKENS))  # in the page prefill sent whole
    assert same_page and all([r.position for r in reads] == past_prefill and None not in [r.slot for r in reads]
                             for reads in same_page), same_page
    if pair:
        other_prefills_serve_it_whole(cluster, ledger_dir, pair[0])
    return v


def other_prefills_serve_it_whole(cluster, ledger_dir, prefill: str) -> None:
    """The truncation scenario's prompts through every prefill but ``prefill`` and each decode:
    answered 200, and every position decode attends to holds KV that prefill wrote for the
    request (the page ledger), where ``prefill``'s lower limit cut them short."""
    since = time.monotonic()  # the ledger's clock
    pairs = [(p, d) for p in cluster.servers("prefill") if p != prefill for d in cluster.servers("decode")]
    answers = [observe_pair(cluster, prompt, p, d)[1] for p, d in pairs for prompt in (OVERSIZED_B, SAME_PAGE)]
    assert all(a.status == 200 for a in answers), answers
    ledger = Ledger(ledger_dir)
    rooms = {e["room"] for e in ledger.of("expose") if e["t"] > since}
    assert len(rooms) == len(answers) and not [r for room in rooms for r in ledger.unowned_reads(room)], rooms


def unowned_reads(ledger_dir, tokens: int) -> list[list]:
    """For each room whose prompt decode held as ``tokens`` tokens: its positions that carry
    KV prefill did not hold for it (``Ledger.unowned_reads``)."""
    ledger = Ledger(ledger_dir)
    rooms = [e["room"] for e in ledger.of("expose") if e["tokens"] == tokens]
    found = [ledger.unowned_reads(room) for room in rooms]
    print(f"\n{tokens}-token prompts: " + "; ".join(
        f"room {reads[0].room}: positions {reads[0].position}-{reads[-1].position} from rooms "
        f"{sorted({r.owner for r in reads}, key=str)}" for reads in found if reads))
    return found


@pytest.mark.claim("H3", "hardened", params=["0.5.23-mooncake"])
@pytest.mark.parametrize("base,backend", core())
def test_hardened_truncation_with_unequal_limits_is_refused(start_cluster, base, backend, tmp_path):
    """H3: the sender fails a transfer that leaves decode pages unwritten; decode refuses a
    prompt whose length differs from prefill's even within one page (the ledger shows the
    three slots of another request reached it). No leak, no 200."""
    hardened_truncation(start_cluster, base, backend, tmp_path)


def hardened_truncation(start_cluster, base: str, backend: str, ledger_dir, page_size: int = 16,
                        extra: dict[str, str] | None = None, model: str = "tiny",
                        layout: dict | None = None, pair: tuple[str, str] | None = None) -> dict[str, Verdict]:
    """The hardened truncation scenario at ``page_size`` on ``model`` (one cluster start, ranks as
    ``layout`` says); ``extra`` probes run beside it, their verdicts returned for the caller to
    judge (pages are idle after). ``pair`` as ``upstream_truncation``'s: the refusals are that
    pair's, and the other prefills serve the prompts whole."""
    cluster = start_cluster(sandbox_env(base, hardened=True), model, backend=backend,
                            **(trunc_params(page_size) | (layout or {})),
                            extra_env=(*DEPTH["extra_env"], f"{writer.DIR_ENV}={ledger_dir}"))
    idle = cluster.used_tokens()
    sent = f"prefill sends {-(-TRUNC_PREFILL_TOKENS // page_size)}"  # pages prefill's 506 tokens fill
    prefill, decode = pair or ("prefill", "decode")
    with phase(f"scenario truncation {base} hardened {backend} page {page_size}"):
        v = observe_probes(cluster, {"pages_apart": OVERSIZED_B, "same_page": SAME_PAGE,
                                     "control": FITTING_C, **(extra or {})}, pair and tenants_apart(cluster, *pair))
    # Pages apart, decode learns of the failed transfer from prefill (by status, or H4's
    # note of prefill's error, whichever comes first); in one page, from its own check.
    assert all(r.status == 500 for r in replies(v["pages_apart"])), v["pages_apart"].replies
    if backend == "mooncake":  # the sender's own check (Mooncake's transfer worker) fired, and its reason
        # reaches the client and decode's log (finding 21.11: they read "prefill might be dead")
        assert sent in cluster.log_tail(prefill, 2000)
        # across decode ranks the client reads rank 0's message, which may be upstream's "unknown
        # reason from another rank" when another rank heard the sender (MLA, TP 2); decode's log
        # names it (below), and nothing is decoded
        named = [r for r in replies(v["pages_apart"]) if "sglang-hardened H3" in r.body and f"but {sent}" in r.body]
        several_ranks = max(cluster.params.role_ranks(role) for role in ("prefill", "decode")) > 1
        assert named == replies(v["pages_apart"]) or several_ranks, v["pages_apart"].replies
        assert shows_nothing_decoded(v["pages_apart"]), v["pages_apart"].replies
        decode_log = cluster.log_tail(decode, 2000)
        assert f"but {sent}" in decode_log and "might be dead" not in decode_log
    assert all(r.status == 500 and "sglang-hardened H3" in r.body for r in replies(v["same_page"])), v["same_page"].replies
    assert any(reads and reads[0].position == TRUNC_PREFILL_TOKENS for reads in unowned_reads(ledger_dir, SAME_PAGE_TOKENS))
    assert all(r.status == 200 for r in replies(v["control"])) and not v["control"].leaked
    assert wait_pages_idle(cluster, idle) == idle
    assert "holds the prompt as 509 tokens" in cluster.log_tail(decode, 2000)
    if pair:
        other_prefills_serve_it_whole(cluster, ledger_dir, prefill)
        assert wait_pages_idle(cluster, idle) == idle
    return v


def test_hardened_0519_without_h1_decode_still_never_reads_unwritten_pages(start_cluster):
    """H3 (with H2, H4) behind a missing H1: 0.5.19's one-token placeholder is sent, and
    decode, whose prompt is 601 tokens, neither answers 200 nor shows another tenant's KV."""
    cluster = start_cluster(sandbox_env("0.5.19", hardened=True, without=("H1",)), **LEAK_PARAMS, **DEPTH)
    idle = cluster.used_tokens()
    with phase("scenario leak 0.5.19 hardened without H1"):
        v = observe_probes(cluster, {"oversized": OVERSIZED_B})
    assert all(r.status in (400, 500) for r in replies(v["oversized"])), v["oversized"].replies
    assert shows_nothing_decoded(v["oversized"]), v["oversized"].replies
    assert wait_pages_idle(cluster, idle) == idle


@pytest.mark.claim("H1", "upstream", params=["upstream"])
@pytest.mark.claim("H2", "upstream", params=["upstream"])
@pytest.mark.claim("H1", "hardened", params=["hardened-h1-without-h2-h4"])
@pytest.mark.parametrize("build", ["upstream", "hardened-h1-without-h2-h4"])
def test_0519_h1_keeps_a_failed_intake_from_transfer(start_cluster, tmp_path, build):
    """H1 isolated from H2 and H4, judged by the page ledger, not by the answers' status:
    upstream 0.5.19 runs its one-token placeholder through prefill and writes it into decode's
    pages; H1 retires the request at prefill's door, so prefill writes nothing. (Decode, whose
    own limit the prompt fits, still allocates and waits, as it does for any prefill failure.)
    Cost: two cluster starts (about 50 s)."""
    env = sandbox_env("0.5.19", hardened=True, without=("H2", "H4")) if build.startswith("hardened") \
        else sandbox_env("0.5.19")
    cluster = start_cluster(env, **TIMEOUT_PARAMS, extra_env=(*DEPTH["extra_env"], f"{writer.DIR_ENV}={tmp_path}"))
    since = time.monotonic()  # the ledger's clock
    at_prefill, at_decode = observe_pair(cluster, OVERSIZED_B)
    written = [e for e in Ledger(tmp_path).of("begin") if e["t"] > since]
    if build == "upstream":
        assert at_prefill.status == 200 and written, (at_prefill, written)
    else:
        assert not written, written
        assert at_prefill.status == 400 and PREFILL_LIMIT_MESSAGE in at_prefill.body, at_prefill
        assert at_decode.status >= 400, at_decode  # without H4, after decode's waiting timeout
    # the positive control: the same ledger sees a fitting prompt's write, so its silence above is H1's
    after = time.monotonic()
    assert cluster.generate(FITTING_C).status == 200
    assert [e for e in Ledger(tmp_path).of("begin") if e["t"] > after], "the ledger saw no write at all"


@pytest.mark.skipif(not FULL_MATRIX, reason="CI shows H12's hole on upstream 0.5.23 (n: null, test_fault_matrix.py); "
                                            "the full matrix runs it")
def test_upstream_0519_answers_a_sampling_parameter_of_the_wrong_type_with_a_bare_500(start_cluster):
    """H12's hole (0.5.19-0.5.21; found by the soak): the parameters' ``TypeError`` escapes the
    generate route, and the client learns nothing of the cause. Cost: one cluster start."""
    cluster = start_cluster(sandbox_env("0.5.19"))
    malformed = generate(cluster.lb_url, FITTING_C, extra=WRONG_TYPE, timeout=60)
    assert malformed.status == 500 and "temperature" not in malformed.body, malformed
    assert cluster.generate(FITTING_C).status == 200, "the server lives on"


@pytest.mark.claim("H2", "hardened")
def test_hardened_0519_h2_alone_reports_the_pending_400(start_cluster):
    """H2 with neither H1 nor H3: the placeholder's transfer succeeds, and prefill answers
    with the pending 400 instead of the 200 upstream 0.5.19 gives."""
    cluster = start_cluster(sandbox_env("0.5.19", hardened=True, without=("H1", "H3")), **TIMEOUT_PARAMS, **DEPTH)
    at_prefill, _ = observe_pair(cluster, OVERSIZED_B)
    assert at_prefill.status == 400 and PREFILL_LIMIT_MESSAGE in at_prefill.body, at_prefill


@pytest.mark.claim("H4", "upstream", params=["0.5.23-mooncake"])
# 0.5.19 leaks instead (test_incident.py); 0.5.20 waits after a one-token forward.
@pytest.mark.parametrize("base,backend", upstream_only([("0.5.23", "mooncake")], bases_from="0.5.20"))
def test_upstream_oversized_prompt_client_waits_for_decode_timeout(share, base, backend):
    """H4's bug: from 0.5.21 prefill rejects at once (0.5.20 after a one-token forward), but
    decode is never told, and mini-lb relays decode's 500 after its waiting timeout. (The cluster
    is test_lb.py's: decode's timeout frees what it held.)"""
    client_waits_for_decode(share(base, backend=backend, **TIMEOUT_PARAMS))


def client_waits_for_decode(cluster) -> None:
    """The upstream timeout scenario on a started cluster of TIMEOUT_PARAMS' limits."""
    base, backend = cluster.params.base, cluster.params.backend
    with phase(f"scenario timeout {base} upstream {backend} page {cluster.params.page_size}"):
        reply = cluster.generate(OVERSIZED_B, timeout=cluster.params.waiting_timeout_s * 4 + 60)
    record_timing("oversized via mini-lb", base, backend, "upstream", reply)
    assert reply.status >= 500, reply
    assert reply.seconds >= cluster.params.waiting_timeout_s - 1, "the error should wait for decode's timeout"


@pytest.mark.parametrize("base,backend", edge())
def test_hardened_oversized_prompt_error_reaches_client_at_once(start_cluster, base, backend):
    """H1/H4 where upstream makes the client wait for decode's waiting timeout."""
    error_reaches_client_at_once(start_cluster(sandbox_env(base, hardened=True), backend=backend,
                                               **TIMEOUT_PARAMS, **DEPTH))


def error_reaches_client_at_once(cluster) -> None:
    """The hardened timeout scenario on a started cluster of TIMEOUT_PARAMS' limits (H7 overridden)."""
    base, backend = cluster.params.base, cluster.params.backend
    idle = cluster.used_tokens()
    obs = observe_oversized_via_lb(cluster)
    record_timing("oversized via mini-lb", base, backend, "hardened", obs.via_lb)
    assert obs.at_prefill.status == 400
    assert obs.via_lb.status == 400 and PREFILL_LIMIT_MESSAGE in obs.via_lb.body, obs.via_lb
    assert before_decode_gives_up(cluster, obs.via_lb), obs.via_lb
    assert wait_pages_idle(cluster, idle) == idle


def test_hardened_prefill_with_tokenizer_workers_is_refused_at_startup(start_cluster):
    """Review finding: with ``--tokenizer-worker-num 2`` prefill's tokenizer workers end the
    requests, and H4's notes of them never reach the bootstrap server that serves decode (main
    started such a prefill, and decode waited its timeout as upstream does). Cost: a start that
    fails within seconds."""
    with pytest.raises(SandboxError, match="exited during start-up(?s:.*)sglang-hardened H4: this prefill server "
                                           "has --tokenizer-worker-num 2"):
        start_cluster(sandbox_env("0.5.23", hardened=True), **TIMEOUT_PARAMS,
                      extra_flags=("--tokenizer-worker-num", "2"))
