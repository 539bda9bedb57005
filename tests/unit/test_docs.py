"""The README's table of bases and CHANGELOG.md follow the lock file and the series (one source
of truth)."""

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


def test_changelog_has_a_section_for_every_revision_of_every_base_newest_first(patches):
    headings = re.findall(r"^## (.*)$", (REPO / "CHANGELOG.md").read_text(), re.M)
    for base in load_lock(patches):
        revisions = [int(n) for heading in headings
                     for b, n in re.findall(r"(\d+\.\d+\.\d+)\+hardened\.(\d+)", heading) if b == base]
        newest = load_series(patches, base).revision
        assert revisions == list(range(newest, 0, -1)), (base, revisions)
