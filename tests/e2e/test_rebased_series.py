"""The rebase job's output serves: 0.5.20's series carried onto 0.5.21 (the backports
upstream already has dropped) builds, and a real PD cluster from it handles the incident prompt.
(0.5.19's series needs a human on 0.5.21: tests/integration/test_rebase.py.)"""

from __future__ import annotations

import pytest

from sglang_hardened.pipeline.rebase import UPSTREAM, rebase, write_series
from tests.harness import phase

from .conftest import sandbox_env
from .scenarios import DEPTH, TIMEOUT_PARAMS, before_decode_gives_up, observe_oversized_via_lb, wait_pages_idle

pytestmark = pytest.mark.e2e


def test_series_rebased_onto_0_5_21_passes_the_oversized_prompt_scenario(start_cluster, tree_copy, drop_base,
                                                                           drop_ids, drop_patches):
    drop_base("0.5.21")
    drop_ids("0.5.20", "H8")  # its seams are per-base variants (tests/integration/test_rebase.py)
    drop_patches("0.5.20", "0023-h5-nixl-drain-ack-after-writes-settle.patch",  # likewise,
                 "0024-h5-backport-nixl-rejected-post.patch",  # what builds on it,
                 "0033-h5-hold-and-release-together-across-ranks.patch",  # and H5's rank agreement
                 "0040-h14-authenticate-bootstrap-registrations.patch",  # each base's copy made by hand
                 "0041-h15-abort-only-the-named-request.patch")  # (tests/integration/test_rebase.py)
    with phase("rebase 0.5.20 -> 0.5.21"):
        result = rebase(tree_copy, "0.5.20", "0.5.21")
    # upstream's own changes, backported: H1's admission check and H5's deferred release (0.5.21)
    assert [v.patch.name for v in result.verdicts if v.verdict == UPSTREAM] == [
        "0004-h1-reject-intake-aborted-requests-at-admission.patch",
        "0008-h5-backport-deferred-release-default-on.patch"]
    write_series(tree_copy, result, force=False)
    cluster = start_cluster(sandbox_env("0.5.21", hardened=True, patches=tree_copy), **TIMEOUT_PARAMS, **DEPTH)
    idle = cluster.used_tokens()
    obs = observe_oversized_via_lb(cluster)
    assert obs.via_lb.status == 400 and before_decode_gives_up(cluster, obs.via_lb), obs.via_lb
    assert wait_pages_idle(cluster, idle) == idle
    assert "carries H0 H1 H2 H3 H4 H5 H6 H7" in cluster.log_tail("decode", 400)
