"""H7 on real servers: unequal input limits across roles, and the operator's override."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request

import pytest

from sglang_hardened.common.knobs import ALLOW_UNSAFE_KV_LIMITS
from sglang_hardened.common.paths import patches_dir
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.runtime.startup import LIMITS_ROUTE, REGISTRATION_FIELD

from .conftest import sandbox_env
from .scenarios import LEAK_PARAMS, METRICS_FLAGS, hardened_metric

pytestmark = pytest.mark.e2e

# Both pools hold their context, but decode's context (and so its input limit)
# is twice prefill's: decode would admit prompts prefill cannot serve.
UNEQUAL = dict(prefill_pool_tokens=600, decode_pool_tokens=4096, context_length=512,
               decode_context_length=1024)
REFUSAL_S = 15  # decode's waiting timeout here: upstream's retries fail a request well within it


@pytest.mark.claim("H7", "upstream")
def test_upstream_0523_serves_with_unequal_input_limits(start_cluster):
    cluster = start_cluster(sandbox_env("0.5.23"), **UNEQUAL)  # ready = a request served through the lb
    assert cluster.generate("the key " * 8).status == 200


@pytest.mark.claim("H7", "hardened")
def test_hardened_0523_decode_refuses_requests_for_a_prefill_with_a_lower_limit_and_keeps_serving(start_cluster):
    """H7 across roles. Finding (review, high): on main decode raised out of its scheduler
    loop at the first request for such a prefill and SGLang shut decode down, and anyone
    who reached prefill's bootstrap port could register a limit of 1 to make every
    prefill such a one. Now decode refuses those requests, logs why once, and stays up;
    a registration upstream rejects leaves the served limit alone."""
    cluster = start_cluster(sandbox_env("0.5.23", hardened=True), **UNEQUAL, waiting_timeout_s=REFUSAL_S,
                            probe_transfer=False, extra_flags=METRICS_FLAGS)
    bootstrap = f"http://127.0.0.1:{cluster.bootstrap_port}"
    served = _get_json(f"{bootstrap}{LIMITS_ROUTE}")["max_req_input_len"]
    forged = urllib.request.Request(f"{bootstrap}/route", method="PUT", headers={"content-type": "application/json"},
                                    data=json.dumps({REGISTRATION_FIELD: 1}).encode())
    with pytest.raises(urllib.error.HTTPError):  # upstream's own parsing rejects it
        urllib.request.urlopen(forged, timeout=30)
    assert _get_json(f"{bootstrap}{LIMITS_ROUTE}")["max_req_input_len"] == served
    reply = cluster.generate("the key " * 8, timeout=REFUSAL_S * 4 + 60)
    assert reply.status >= 500, reply
    with urllib.request.urlopen(f"{cluster.decode_url}/health", timeout=30) as health:
        assert health.status == 200, "decode stays up"
    log = cluster.log_tail("decode", 2000)
    assert re.search(rf"sglang-hardened H7: this decode accepts inputs up to \d+ tokens but the prefill at "
                     rf".* only up to {served}", log), log[-3000:]
    assert log.count(f"only up to {served}") == 1, "a refusal upstream retries each cycle is logged once"
    assert hardened_metric(cluster, "decode", "requests_refused_total", id="H7", reason="limit_below_decode") >= 1


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)


def test_hardened_0519_override_starts_and_both_checks_say_so(start_cluster):
    env = sandbox_env("0.5.19", hardened=True)
    cluster = start_cluster(env, **LEAK_PARAMS, extra_env=(f"{ALLOW_UNSAFE_KV_LIMITS.name}=1",))
    assert f"Starting anyway: {ALLOW_UNSAFE_KV_LIMITS.name}=1 overrides this check" in cluster.log_tail("prefill", 400)
    assert f"Serving anyway: {ALLOW_UNSAFE_KV_LIMITS.name}=1 overrides this check" in cluster.log_tail("decode", 400)
    # H0 on a live server: the start-up line, /server_info, and sglang.__version__ itself.
    series = load_series(patches_dir(), "0.5.19")
    hardened_version = f"0.5.19+hardened.{series.revision}"
    assert f"sglang-hardened: sglang {hardened_version} carries {' '.join(series.hardening_ids)}" in cluster.log_tail("prefill", 400)
    with urllib.request.urlopen(f"{cluster.decode_url}/server_info", timeout=30) as reply:
        hardening = json.load(reply)["hardening"]
    assert hardening["hardened"] and hardening["hardening_ids"] == series.hardening_ids
    version = subprocess.run([str(env.python), "-c", "import sglang; print(sglang.__version__)"],
                             env=env.environ(), capture_output=True, text=True, timeout=300, cwd="/")
    assert version.stdout.strip().splitlines()[-1] == hardened_version, version.stderr[-2000:]
