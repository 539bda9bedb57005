"""The judging halves of preflight and canary, on cases the e2e clusters cannot produce.

preflight: mismatched nodes (the reports are /server_info fields as real 0.5.23 nodes return
them). canary: an answer holding another tenant's canary (the tiny sandbox model never echoes one).
"""

from __future__ import annotations

from sglang_hardened.operations.canary import _cross_tenant
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


def test_canary_flags_an_answer_with_another_tenants_canary_probes_included():
    canaries = {"tenant-0": "CANARY-a", "tenant-1": "CANARY-b"}
    clean = [("CANARY-a is mine", Reply(200, (1,), '{"text": "CANARY-a"}', 0.1))]
    assert _cross_tenant(clean, canaries).ok
    leaked = clean + [("CANARY-b is mine", Reply(200, (1,), '{"text": "saw CANARY-a"}', 0.1)),
                      ("the key", Reply(200, (1,), '{"text": "CANARY-b"}', 0.1))]
    check = _cross_tenant(leaked, canaries)
    assert not check.ok
    assert check.detail == "tenant-1's answer holds tenant-0's canary; a probe's answer holds tenant-1's canary"
