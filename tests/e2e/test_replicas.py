"""PD with several servers per role (2 prefills x 2 decodes), as production runs it behind a
gateway that pairs a prefill and a decode per request: the hardening's per-peer state, which
a single pair never exercises, on real servers.

Each request here is sent to the pair it names, as a balancer that chose that pair sends it
(``observe_pair``), so which prefill and which decode served it is known.

Tier and cost (2026-12-06, `scripts/test tests/e2e/test_replicas.py` on the shared 2-core
machine, load average 20): the gate runs the H7 pair, two 2x2 starts (upstream and hardened
0.5.23: 66 s and 107 s), 224 s in all.
"""

from __future__ import annotations

import re

import pytest

from .conftest import sandbox_env
from .scenarios import METRICS_FLAGS, hardened_metric, observe_pair, prompt_of

pytestmark = pytest.mark.e2e

# prefill-1 is the smaller one: a 600-token pool, so a 600-token context and an input limit of
# 594, where prefill's and both decodes' is 1018. Each decode must judge each prefill on its own.
UNEQUAL_PREFILLS = dict(prefills=2, decodes=2, prefill_limits=(1024, 600), context_length=1024,
                        waiting_timeout_s=15, extra_flags=METRICS_FLAGS)
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
