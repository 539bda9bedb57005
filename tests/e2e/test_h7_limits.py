"""H7 on real servers: unequal input limits across roles, and the operator's override."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from sglang_hardened.paths import patches_dir
from sglang_hardened.runtime.startup import OVERRIDE_ENV
from sglang_hardened.sandbox.env import SandboxError
from sglang_hardened.series import load_series

from .conftest import sandbox_env
from .scenarios import LEAK_PARAMS

pytestmark = pytest.mark.e2e

# Both pools hold their context, but decode's context (and so its input limit)
# is twice prefill's: decode would admit prompts prefill cannot serve.
UNEQUAL = dict(prefill_pool_tokens=600, decode_pool_tokens=4096, context_length=512,
               decode_context_length=1024)


def test_upstream_0523_serves_with_unequal_input_limits(start_cluster):
    cluster = start_cluster(sandbox_env("0.5.23"), **UNEQUAL)  # ready = a request served through the lb
    assert cluster.generate("the key " * 8).status == 200


def test_hardened_0523_decode_refuses_a_prefill_with_a_lower_input_limit(start_cluster):
    with pytest.raises(SandboxError, match=r"(?s)sglang-hardened H7: this decode accepts inputs up to \d+ "
                                           r"tokens but the prefill at .* only up to \d+"):
        start_cluster(sandbox_env("0.5.23", hardened=True), **UNEQUAL)


def test_hardened_0519_override_starts_and_both_checks_say_so(start_cluster):
    env = sandbox_env("0.5.19", hardened=True)
    cluster = start_cluster(env, **LEAK_PARAMS, extra_env=(f"{OVERRIDE_ENV}=1",))
    assert f"Starting anyway: {OVERRIDE_ENV}=1 overrides this check" in cluster.log_tail("prefill", 400)
    assert f"Serving anyway: {OVERRIDE_ENV}=1 overrides this check" in cluster.log_tail("decode", 400)
    # H0 on a live server: the start-up line, /server_info, and sglang.__version__ itself.
    ids = load_series(patches_dir(), "0.5.19").hardening_ids
    assert f"sglang-hardened: sglang 0.5.19+hardened.1 carries {' '.join(ids)}" in cluster.log_tail("prefill", 400)
    with urllib.request.urlopen(f"{cluster.decode_url}/server_info", timeout=30) as reply:
        hardening = json.load(reply)["hardening"]
    assert hardening["hardened"] and hardening["hardening_ids"] == ids
    version = subprocess.run([str(env.python), "-c", "import sglang; print(sglang.__version__)"],
                             env=env.environ(), capture_output=True, text=True, timeout=300, cwd="/")
    assert version.stdout.strip().splitlines()[-1] == "0.5.19+hardened.1", version.stderr[-2000:]
