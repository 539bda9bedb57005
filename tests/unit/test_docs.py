"""The README's table of bases follows the lock file and the series (one source of truth)."""

from __future__ import annotations

import re

from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import hardened_version
from tests.harness import REPO


def test_readme_bases_table_matches_lock_and_series(patches):
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (\d+\.\d+\.\d+\S*) \| (\S+) \|", readme, re.M)
    expected = [(b, hardened_version(b, load_series(patches, b).revision)) for b in load_lock(patches)]
    assert rows == expected
