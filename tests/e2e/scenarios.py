"""The incident, as scenarios run against upstream (vulnerable) and hardened builds.

Tenant B sends a prompt longer than the prefill KV pool but within the context
length: upstream treats it as an input-length abort, sends one page of KV and,
before 0.5.21, lets decode run over pages the transfer never wrote.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import re
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from packaging.version import Version

from sglang_hardened.common.knobs import ALLOW_UNSAFE_KV_LIMITS
from sglang_hardened.common.knobs import E2E_MATRIX
from sglang_hardened.operations.oracle import Reply, Verdict, differential_checks, generate
from sglang_hardened.sandbox.cluster import BACKENDS, Cluster
from sglang_hardened.sandbox.env import bases
from sglang_hardened.sandbox.soak.faults import abort_request

# Token counts are those of the sandbox tokenizer.
TENANT_A = {"A1": "alpha tenant secret " * 60, "A2": "bravo decode value " * 60}  # 180 tokens: fits
A_TOKENS = 180
OVERSIZED_B = "page cache token key of the " * 100  # 600 tokens: > prefill pool, < context
FITTING_C = "the key " * 40  # 80 tokens: control probe

# Decode's pool must hold B + its 512-token reserve, and be small enough that
# tenant A's requests cycle its whole free list (taken from the front, freed to
# the back), so that B's unwritten pages hold A's KV rather than never-used zeros.
LEAK_PARAMS = dict(prefill_pool_tokens=256, decode_pool_tokens=1200, context_length=1024)
TIMEOUT_PARAMS = dict(prefill_pool_tokens=256, decode_pool_tokens=4096, context_length=1024,
                      waiting_timeout_s=15)

# CI runs every scenario on CORE and one on 0.5.20 (EDGE), where no other CI test runs a hardened
# cluster: 0.5.21's is the rebased series' (test_rebased_series.py, the same patches), 0.5.22's
# and both NIXL builds' are the fault matrix's (H1 and H4, what the scenario shows, do not touch
# the transport). SGLANG_HARDENED_E2E_MATRIX=full runs every scenario everywhere (README,
# docs/e2e-matrix.md).
FULL_MATRIX = E2E_MATRIX.get() == "full"
CORE = [("0.5.19", "mooncake"), ("0.5.23", "mooncake")]
EVERYWHERE = [(base, backend) for base in bases() for backend in BACKENDS]
EDGE = [("0.5.20", "mooncake")]


def core() -> list[tuple[str, str]]:
    """(base, backend) pairs that run every scenario."""
    return EVERYWHERE if FULL_MATRIX else CORE


def upstream_only(ci: list[tuple[str, str]], bases_from: str = "0.5.19") -> list[tuple[str, str]]:
    """Where a test reproduces upstream's bug: ``ci`` in CI (one base shows it; the
    hardened tests run everywhere CI runs them), every pair from ``bases_from`` on in
    the full matrix."""
    return [(b, k) for b, k in EVERYWHERE if Version(b) >= Version(bases_from)] if FULL_MATRIX else ci


def edge() -> list[tuple[str, str]]:
    """The pairs that run one scenario only (none in the full matrix: they run them all)."""
    return [] if FULL_MATRIX else EDGE


# Defence in depth behind H7 (which refuses these configurations at start-up):
# the same clusters with both H7 checks overridden.
DEPTH = dict(extra_env=(f"{ALLOW_UNSAFE_KV_LIMITS.name}=1",))


def prompt_of(tokens: int) -> str:
    """A prompt of exactly ``tokens`` sandbox-tokenizer tokens ("the", " key", ..., " ")."""
    pairs, odd = divmod(tokens - 1, 2)
    return "the key " * pairs + ("the " if odd else "")


# Prefill's input limit with a 256-token pool is min(1024 - 1, 256 - 1) - 5 = 250;
# upstream rejects a prompt of >= 250 tokens, so 249 is the longest it takes.
AT_LIMIT, OVER_LIMIT = prompt_of(249), prompt_of(250)
CHUNKED = prompt_of(201)  # four 64-token chunks: needs chunked prefill, fits the pool
BOUNDARY_PARAMS = dict(**LEAK_PARAMS, chunked_prefill_size=64)
# A configuration H7 accepts: both pools hold the context (and decode its 512-token reserve).
# 120 one-token pages: over the page ledger's slow-call threshold (sgl_ledger.SLOW_MIN_PAGES).
SLOW_PROMPT = prompt_of(120)
SAFE_PARAMS = dict(prefill_pool_tokens=1024, decode_pool_tokens=1600, context_length=1024)

# The roles disagree on the prompt: --allow-auto-truncate with prefill's input
# limit (min(511, 1023) - 5 = 506) below decode's (1018), pages of 16 tokens.
# OVERSIZED_B (601 tokens) ends 6 pages later on decode than on prefill;
# SAME_PAGE (509) ends in the same page on both (only decode's own check sees it).
TRUNC_PARAMS = dict(prefill_pool_tokens=1024, decode_pool_tokens=1200, context_length=512,
                    decode_context_length=1024, page_size=16, extra_flags=("--allow-auto-truncate",))
TRUNC_PREFILL_TOKENS = 506  # what prefill keeps of a longer prompt there
SAME_PAGE_TOKENS = 509
SAME_PAGE = prompt_of(SAME_PAGE_TOKENS)
# Page size 64, the recipe's default. With 64-token pages prefill's 506 tokens end in page 7
# (448-511), as SAME_PAGE does; LAST_PAGE (530) ends one page later on decode, in page 8, partly filled
# and the one page no transfer writes. PAGE_ENDS fit both limits: prompts either side of page ends.
RECIPE_PAGE = 64
LAST_PAGE_TOKENS = 530
LAST_PAGE = prompt_of(LAST_PAGE_TOKENS)
PAGE_ENDS = {f"ends_{n}": prompt_of(n) for n in (63, 64, 65, 127, 128, 129)}


def trunc_params(page_size: int) -> dict:
    """TRUNC_PARAMS with ``page_size``-token pages, decode's pool rounded up to whole pages."""
    pool = TRUNC_PARAMS["decode_pool_tokens"]
    return TRUNC_PARAMS | {"page_size": page_size, "decode_pool_tokens": -(-pool // page_size) * page_size}


@dataclass
class LeakObservation:
    oversized: Verdict  # probe B after tenant A1 / A2, two rounds
    control: Verdict  # probe C (fits) after the same histories


def observe_probes(cluster: Cluster, probes: dict[str, str],
                   send: Callable[[str], Reply] | None = None) -> dict[str, Verdict]:
    """Each probe after tenant A1's and A2's histories (two rounds): enough A requests
    to cycle decode's whole free list, so unwritten pages hold A's KV, not zeros. Sent
    through the cluster's load balancer, or by ``send`` (``via_pair``: one prefill and decode;
    or a sender that injects a fault into the probes only)."""
    repeats = math.ceil(cluster.params.decode_pool_tokens / A_TOKENS) + 1
    histories = {label: [prompt] * repeats for label, prompt in TENANT_A.items()}
    return differential_checks(send or cluster.generate, probes, histories, rounds=2)


def observe_leak(cluster: Cluster) -> LeakObservation:
    v = observe_probes(cluster, {"oversized": OVERSIZED_B, "control": FITTING_C})
    return LeakObservation(oversized=v["oversized"], control=v["control"])


def replies(verdict: Verdict) -> list[Reply]:
    return [r for rs in verdict.replies.values() for r in rs]


def shows_nothing_decoded(verdict: Verdict) -> bool:
    """Every reply is a refusal whose body carries no decoded output (no ids, no text), so no
    other tenant's KV can reach the client through it (the oracle compares outputs, and
    refusals have none to compare)."""
    return all(r.status != 200 and '"output_ids"' not in r.body and '"text"' not in r.body for r in replies(verdict))


def before_decode_gives_up(cluster: Cluster, reply: Reply) -> bool:
    """The client had its answer well inside decode's waiting timeout (half of it), where
    upstream answers only once that timeout has run: an order tied to the configuration,
    not to how fast a shared host is (the measured times go to the timing table)."""
    return reply.seconds < cluster.params.waiting_timeout_s / 2


def wait_pages_idle(cluster: Cluster, idle: dict[str, int], timeout_s: float = 60.0) -> dict[str, int]:
    """Wait until both roles hold as many KV tokens as before the scenario (no page
    leaked); a page held for a deferred release comes back within its timeout."""
    deadline = time.monotonic() + timeout_s
    while (used := cluster.used_tokens()) != idle and time.monotonic() < deadline:
        time.sleep(0.5)
    return used


@dataclass
class TimeoutObservation:
    at_prefill: Reply  # B sent to prefill alone, as the lb would
    via_lb: Reply  # B through mini-lb (prefill and decode)


def bootstrap_fields(cluster: Cluster, prefill: str = "prefill") -> dict:
    """The fields a load balancer adds: where decode meets ``prefill`` (a server's name), and a
    fresh room."""
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster.bootstrap_ports[prefill],
            "bootstrap_room": random.getrandbits(62)}


def observe_pair(cluster: Cluster, prompt: str, prefill: str = "prefill", decode: str = "decode",
                 max_new_tokens: int = 8, prefill_prompt: str | None = None) -> tuple[Reply, Reply]:
    """What ``prefill`` and ``decode`` (servers' names) each answer to one request sent to both,
    as a load balancer that paired them does (mini-lb shows the client decode's answer only).
    ``prefill_prompt``: what prefill is sent in place of ``prompt``, as if its input limit had
    truncated it (``--allow-auto-truncate`` below decode's limit) on a cluster whose limits agree."""
    bootstrap = bootstrap_fields(cluster, prefill)
    timeout = cluster.params.waiting_timeout_s * 4 + 60
    with ThreadPoolExecutor(2) as pool:
        at_prefill, at_decode = (pool.submit(generate, cluster.procs[name].url, text, max_new_tokens, timeout,
                                             bootstrap)
                                 for name, text in ((prefill, prefill_prompt or prompt), (decode, prompt)))
        return at_prefill.result(), at_decode.result()


def via_pair(cluster: Cluster, prefill: str, decode: str) -> Callable[[str], Reply]:
    """A sender for the differential oracle through one pair of a many-server cluster: what
    the client of a balancer that chose that pair is shown (decode's answer)."""
    return lambda prompt: observe_pair(cluster, prompt, prefill, decode)[1]


def tenants_apart(cluster: Cluster, prefill: str = "prefill-1", decode: str = "decode-1") -> Callable[[str], Reply]:
    """A balancer's choices for the incident across instances: every probe through ``prefill`` and
    ``decode``, tenant A's history through another prefill and the same decode. The pages a probe
    is given on ``decode`` last held the KV another prefill wrote there for another tenant."""
    other = next(name for name in cluster.servers("prefill") if name != prefill)
    history, probes = via_pair(cluster, other, decode), via_pair(cluster, prefill, decode)
    return lambda prompt: (history if prompt in TENANT_A.values() else probes)(prompt)


def observe_oversized_via_lb(cluster: Cluster) -> TimeoutObservation:
    at_prefill = generate(cluster.prefill_url, OVERSIZED_B, extra=bootstrap_fields(cluster), timeout=60)
    via_lb = cluster.generate(OVERSIZED_B, timeout=cluster.params.waiting_timeout_s * 4 + 60)
    return TimeoutObservation(at_prefill, via_lb)


# SGLang's /metrics on both servers, where the hardened runtime's counters go too (runtime/metrics.py)
METRICS_FLAGS = ("--enable-metrics",)
# decode notices a dead prefill within about 4 s, and bootstraps anew from one restarted in its place
HEARTBEAT = ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL=2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE=2")


def hardened_samples(cluster: Cluster, role: str) -> list:
    """``role``'s samples of the runtime's metrics (``sglang_hardened_*``) on its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{cluster.procs[role].url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("sglang_hardened_")]


def hardened_metric(cluster: Cluster, role: str, name: str, served: bool = True, **labels: str) -> float:
    """The sum of ``role``'s samples ``sglang_hardened_<name>`` whose labels include ``labels``
    (0 when it has none). A hardened server serves every listed series from its start (at 0),
    so a role that serves no hardened metric at all fails the test (metrics off, or not a
    hardened build, must not read as zero), unless ``served`` is False: the caller then shows
    the cluster serves them elsewhere."""
    samples = hardened_samples(cluster, role)
    assert samples or not served, f"{role}'s /metrics serves no sglang_hardened_ metric: not a hardened build, or metrics off"
    return sum(s.value for s in samples if s.name == f"sglang_hardened_{name}" and labels.items() <= s.labels.items())


def post(url: str, payload: dict, path: str = "/generate") -> http.client.HTTPConnection:
    """Send a request and leave its answer unread: the caller reads it or hangs up."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(payload), headers={"content-type": "application/json"})
    return conn


def hang_up(conns: list[http.client.HTTPConnection]) -> None:
    """The client goes away: its sockets close without reading the answers."""
    for conn in conns:
        if conn.sock is not None:
            conn.sock.close()
        conn.close()


# --- H14: the bootstrap server's registration table --------------------------------------------

RANK0 = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
ATTACKER = "127.0.0.2"  # another host as the bootstrap server sees it (loopback is a /8)
DEAD_PORT = 9  # discard: nothing listens there


def bootstrap_call(cluster: Cluster, method: str, path: str, body: dict | str | None = None,
                   headers: dict | None = None, source: str = "127.0.0.1") -> tuple[int, str]:
    """One request to prefill's bootstrap server from ``source``: (status, text)."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.bootstrap_port, timeout=10, source_address=(source, 0))
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})
        reply = conn.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    finally:
        conn.close()


def rank0_registration(cluster: Cluster) -> tuple[dict, dict]:
    """Rank 0's entry as decode reads it, and a registration upstream 0.5.23 takes for it (every
    field its handler requires, from what the server says of itself)."""
    status, text = bootstrap_call(cluster, "GET", f"/route?{RANK0}")
    assert status == 200, (status, text)
    entry = json.loads(text)
    status, text = bootstrap_call(cluster, "GET", "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
    assert status == 200, (status, text)
    info = json.loads(text)
    body = {"attn_tp_size": info["attn_tp_size"], "attn_tp_rank": 0, "attn_cp_size": info["attn_cp_size"],
            "attn_cp_rank": 0, "attn_dp_size": info["dp_size"], "attn_dp_rank": 0, "pp_size": info["pp_size"],
            "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0, "page_size": info["page_size"],
            "kv_cache_dtype": info["kv_cache_dtype"], "prefill_http_port": info["prefill_http_port"],
            "decode_allocation_policy": info["decode_allocation_policy"], **entry}
    return entry, body


# --- H15: an abort by rid --------------------------------------------------------------------

ATTACKER_RIDS = "0123456789abcdef"  # every first character a uuid4 hex rid can have


@contextlib.contextmanager
def rid_prefix_attack(cluster: Cluster) -> Iterator[list[Future[Reply]]]:
    """Four victims wait on decode for their prefill (their rids uuid4 hex, as SGLang makes
    them), then a client sends requests with the rids "0" to "f", as a gateway that passes rids
    on forwards them, and hangs up. Yields the victims' replies to come; on leaving, each victim
    still waiting is ended by an abort naming its own rid."""
    rids = [uuid.uuid4().hex for _ in range(4)]
    with ThreadPoolExecutor(len(rids)) as pool:
        victims = [pool.submit(generate, cluster.decode_url, FITTING_C, 4, 120,
                               {"rid": rid, **bootstrap_fields(cluster)}) for rid in rids]
        try:
            conns = [post(cluster.decode_url, {"text": FITTING_C, "rid": rid, **bootstrap_fields(cluster)})
                     for rid in ATTACKER_RIDS]
            time.sleep(2.0)  # the attacker's requests are the decode's before it hangs up (µs apart)
            hang_up(conns)
            yield victims
        finally:
            for rid, victim in zip(rids, victims):
                if not victim.done():
                    abort_request(cluster.decode_url, rid)
            wait(victims, 60)


def attacker_aborts(cluster: Cluster) -> set[str]:
    """The attacker's rids whose requests decode's log shows ended by their abort."""
    return set(re.findall(r"rid='([0-9a-f])'.*Aborted by AbortReq", cluster.log_tail("decode", 4000)))
