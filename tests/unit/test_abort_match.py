"""H15's rule for which requests an abort ends (the e2e twins: test_upstream_defaults.py and
test_probes_safe.py, on real servers)."""

from __future__ import annotations

import pytest

from sglang_hardened.runtime.abort_match import aborts


@pytest.mark.parametrize("rid, named, ended", [
    ("3f2a9c", "3f2a9c", True),  # the request itself
    ("job_0", "job", True), ("job_17", "job", True),  # a batch's or parallel samples' members
    ("3f2a9c", "3", False),  # another tenant's server-made rid it prefixes: the hole
    ("job_17x", "job", False), ("job_", "job", False), ("job__1", "job", False),
    ("jobs_1", "job", False), ("job", "job_1", False),
    ("lb-ab12-01", "lb-ab12-0", False),  # our lb's batch rids are of one width for this reason
])
def test_an_abort_ends_the_rid_it_names_and_its_numbered_members(rid, named, ended):
    assert aborts(rid, named) is ended
