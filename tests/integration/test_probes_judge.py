"""The judging halves of preflight and canary, on cases the e2e clusters cannot produce.

preflight: mismatched nodes (the reports are /server_info fields as real 0.5.23 nodes return
them). canary: deployments whose model repeats its prompt (a real LLM: the tiny sandbox model's
random weights never echo a canary, so the e2e clusters cannot show that check failing).
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from sglang_hardened.operations.canary import PROGRESS_EVERY, Plan, _cross_tenant, run_canary
from sglang_hardened.operations.oracle import Reply
from sglang_hardened.operations.preflight import Node, judge

HARDENING = {"hardened": True, "base": "0.5.23", "version": "0.5.23+hardened.1", "hardening_ids": ["H0", "H7"]}
SAFE = {"version": "0.5.23+hardened.1", "hardening": HARDENING, "max_total_num_tokens": 4096, "context_length": 1024,
        "max_req_input_len": 1018, "page_size": 1, "kv_cache_dtype": "auto", "dtype": "float32",
        "enable_page_major_kv_layout": False, "disaggregation_transfer_backend": "mooncake",
        "disaggregation_enable_kv_checksum": True}


def _findings(prefill: dict, decode: dict) -> set[tuple[str, str]]:
    return {(f.severity, f.what.split(":")[0]) for f in
            judge([Node("prefill", "http://p", {**SAFE, **prefill}), Node("decode", "http://d", {**SAFE, **decode})])}


def test_a_safe_pair_has_no_finding():
    assert _findings({}, {}) == set()


def test_layout_backend_and_checksum_mismatches_are_unsafe():
    found = _findings({"page_size": 16, "disaggregation_transfer_backend": "nixl"},
                      {"kv_cache_dtype": "fp8_e4m3", "disaggregation_enable_kv_checksum": False})
    assert {("unsafe", f"{key} differs across nodes") for key in
            ("page_size", "kv_cache_dtype", "disaggregation_transfer_backend",
             "disaggregation_enable_kv_checksum")} <= found
    assert ("warn", "KV checksums are off") in found


def test_unreachable_and_old_unhardened_nodes():
    nodes = [Node("prefill", "http://p", None, "/server_info: refused"),
             Node("decode", "http://d", {**SAFE, "version": "0.5.20", "hardening": None})]
    found = {(f.severity, f.where, f.what.split(" (")[0]) for f in judge(nodes)}
    assert ("unsafe", "prefill http://p", "not reachable") in found
    assert ("unsafe", "decode http://d", "sglang 0.5.20 is not a hardened build") in found
    assert ("warn", "decode http://d", "deferred KV release is off by default on 0.5.20 and cannot be read remotely") in found


def test_deferred_release_is_judged_from_what_the_node_says_is_in_effect():
    """Review finding: preflight judged deferred release from the version, not the live setting."""
    off = {"hardening": {**HARDENING, "deferred_decode_kv_release": False}}
    assert ("unsafe", "deferred KV release is off") in _findings(off, off)
    on_old = {"version": "0.5.20+hardened.9", "hardening": {**HARDENING, "base": "0.5.20", "deferred_decode_kv_release": True}}
    assert not {f for f in _findings(on_old, on_old) if "deferred" in f[1]}


def test_page_tags_switched_off_are_unsafe_on_the_node_that_says_so():
    off = {"hardening": {**HARDENING, "page_tags": False}}
    assert _findings(off, {}) == {("unsafe", "H8's page tags are switched off")}
    assert _findings({"hardening": {**HARDENING, "page_tags": True}}, {}) == set()


def test_canary_flags_an_answer_with_another_tenants_canary_probes_included():
    canaries = {"tenant-0": "CANARY-a", "tenant-1": "CANARY-b"}
    clean = [("CANARY-a is mine", Reply(200, (1,), '{"text": "CANARY-a"}', 0.1))]
    assert _cross_tenant(clean, canaries).ok
    leaked = clean + [("CANARY-b is mine", Reply(200, (1,), '{"text": "saw CANARY-a"}', 0.1)),
                      ("the key", Reply(200, (1,), '{"text": "CANARY-b"}', 0.1))]
    check = _cross_tenant(leaked, canaries)
    assert not check.ok
    assert check.detail == "tenant-1's answer holds tenant-0's canary; a probe's answer holds tenant-1's canary"


POOL, CONTEXT = 256, 512


def _standin(leaks: bool, copies: bool = True):
    """Stand-in for a deployment whose model copies its prompt (a real LLM needs a GPU), as a
    /generate answer: it answers "Repeat X's secret:" with the canary in the KV it attends, and
    any other prompt with ids hashed from that KV. A leaking one attends the pages the last
    tenant's prompt left and answers a prompt over the pool with 200 (the incident); a safe one
    attends its own prompt and refuses that prompt with a 400. ``copies=False`` answers never
    repeat a canary. Its /tokenize counts a word a token (tests/integration/test_prompt_lengths.py
    has the real tokenizer)."""
    last_tenant = [""]

    def answer(path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/tokenize":
            return 200, json.dumps({"count": [len(t.split()) for t in json.loads(body)["prompt"]]}).encode()
        prompt = json.loads(body)["text"]
        tokens = len(prompt.split())
        if tokens > POOL and not leaks:
            return 400, json.dumps({"error": {"message": "input is longer than the KV pool"}}).encode()
        kv = last_tenant[0] if leaks and last_tenant[0] else prompt
        if "secret" in prompt:
            last_tenant[0] = prompt
        canary = re.search(r"CANARY-\w+", kv)
        text = canary.group(0) if copies and "Repeat" in prompt and canary else "the"
        ids = list(hashlib.sha256(kv.encode()).digest()[:4])
        return 200, json.dumps({"text": text, "output_ids": ids, "meta_info": {"prompt_tokens": tokens}}).encode()

    return answer


@pytest.fixture
def deployment(http_stand_in):
    return lambda **kind: f"http://{http_stand_in(_standin(**kind))}"


def _results(url: str) -> dict[str, str]:
    report = run_canary(url, Plan(POOL, CONTEXT, repeats=2, rounds=1))
    return {c.name.split(" (")[0]: c.result for c in report.checks} | {"report": "ok" if report.ok else "FAIL"}


def test_every_canary_check_fails_on_a_deployment_that_leaks(deployment):
    """Review finding 21.8: an 8-token greedy answer could never hold another tenant's
    12-hex-digit canary, so that check could not fail; now each check fails here."""
    assert _results(deployment(leaks=True)) == {
        "no tenant sees another's canary": "FAIL", "over-pool prompt": "FAIL",
        "over-pool probe independent of the previous tenant": "FAIL",
        "fitting probe independent of the previous tenant": "FAIL", "report": "FAIL"}


def test_a_safe_deployment_passes_every_check_it_can_judge(deployment):
    assert _results(deployment(leaks=False)) == {
        "no tenant sees another's canary": "ok", "over-pool prompt": "ok",
        "over-pool probe independent of the previous tenant": "n/a",
        "fitting probe independent of the previous tenant": "ok", "report": "ok"}


def test_the_canary_says_how_far_it_is(deployment):
    """A CronJob's log shows a slow probe moving: a line every PROGRESS_EVERY requests."""
    plan, lines = Plan(POOL, CONTEXT, repeats=2, rounds=1), []
    report = run_canary(deployment(leaks=False), plan, progress=lines.append)
    assert lines == [f"canary: {n} of {plan.requests_needed} requests sent, {line.split(', ')[1]}"
                     for n, line in zip(range(PROGRESS_EVERY, report.requests + 1, PROGRESS_EVERY), lines)]
    assert len(lines) == report.requests // PROGRESS_EVERY > 0
    quiet = _results(deployment(leaks=False, copies=False))
    assert quiet["no tenant sees another's canary"] == "n/a", "a model that never repeats a canary proves nothing"
    assert quiet["report"] == "ok"
