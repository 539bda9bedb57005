"""A hardened decode behind an unhardened prefill (a rolling upgrade half done, which preflight
flags): decode cannot tell the pages that prefill's transfer wrote from stale ones, so it refuses
every request before decoding rather than vouch for them. H3 refuses for want of prefill's
coverage stamp; a decode built without H3 refuses by H8's page tags, which no unhardened prefill
writes. The upstream decode of the same cluster serves these requests (every other test's
upstream cluster): the refusal is the hardened rule, not a broken transfer. H7's check of
prefill's input limit reads a 404 and lets the request through to these checks.

Cost: two cluster starts (upstream 0.5.23 prefill, hardened decode), a few requests each.
"""

from __future__ import annotations

import pytest

from sglang_hardened.common.knobs import PAGE_TAGS_COST_EVERY
from sglang_hardened.operations.oracle import Verdict
from tests.harness import phase

from .conftest import sandbox_env
from .scenarios import FITTING_C, METRICS_FLAGS, SAFE_PARAMS, hardened_metric, shows_nothing_decoded, wait_pages_idle

pytestmark = pytest.mark.e2e

BASE = "0.5.23"
# the hardening item that refuses, the decode build (the items it leaves out), what decode's log says,
# the reason decode's /metrics counts it under (runtime/metrics.py)
REFUSERS = {"H3": ((), "did not state how many prompt tokens its transfer covers", "unstated_coverage"),
            "H8": (("H3", "H4"), "do not carry its tag", "tag_mismatch")}


@pytest.mark.parametrize("item", REFUSERS)
def test_hardened_decode_refuses_what_an_unhardened_prefill_sent(start_cluster, item):
    without, logged, reason = REFUSERS[item]
    # every request is refused, so the cluster is ready when the lb is, not when one is served
    cluster = start_cluster(sandbox_env(BASE, hardened=True, without=without), prefill_env=sandbox_env(BASE),
                            **SAFE_PARAMS, probe_transfer=False, extra_flags=METRICS_FLAGS,
                            extra_env=(f"{PAGE_TAGS_COST_EVERY.name}=1",))  # H8's cost metered, so its histogram fills
    idle = cluster.used_tokens()
    with phase(f"scenario unhardened prefill {BASE} hardened decode by {item}"):
        got = [cluster.generate(FITTING_C) for _ in range(2)]
    assert all(r.status == 500 and f"sglang-hardened {item}" in r.body for r in got), got
    assert shows_nothing_decoded(Verdict({"probe": got})), got
    decode_log = cluster.log_tail("decode", 4000)
    assert logged in decode_log and "is not hardened" in decode_log
    assert hardened_metric(cluster, "decode", "requests_refused_total", id=item, reason=reason) >= len(got)
    if item == "H8":  # each refusal came from a tag check whose time was observed
        assert hardened_metric(cluster, "decode", "page_tag_op_seconds_count", op="check") >= len(got)
    assert wait_pages_idle(cluster, idle) == idle
