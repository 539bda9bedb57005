"""The patch applier on small trees: offsets, already-applied, creation, failures."""

from __future__ import annotations

import pytest

from sglang_hardened.pipeline import unidiff

DIFF = """--- a/f.py
+++ b/f.py
@@ -2,3 +2,4 @@
 b
 c
+inserted
 d
@@ -7,2 +8,2 @@
 g
-h
+H
"""


def write(tmp_path, lines):
    (tmp_path / "f.py").write_text("".join(f"{x}\n" for x in lines))


def test_applies_exactly_and_reports_zero_offsets(tmp_path):
    write(tmp_path, "abcdefgh")
    [result] = unidiff.apply(tmp_path, DIFF)
    assert result.offsets == [0, 0]
    assert (tmp_path / "f.py").read_text().split() == list("abc") + ["inserted"] + list("defgH")


def test_applies_at_an_offset_and_says_so(tmp_path):
    write(tmp_path, ["x", "y", *"abcdefgh"])
    [result] = unidiff.apply(tmp_path, DIFF)
    assert result.offsets == [2, 2]
    assert (tmp_path / "f.py").read_text().split()[-1] == "H"


def test_dry_run_changes_nothing(tmp_path):
    write(tmp_path, "abcdefgh")
    unidiff.apply(tmp_path, DIFF, write=False)
    assert (tmp_path / "f.py").read_text().split() == list("abcdefgh")


def test_already_applied_is_told_apart_from_a_conflict(tmp_path):
    write(tmp_path, "abcdefgh")
    unidiff.apply(tmp_path, DIFF)
    [again] = unidiff.apply(tmp_path, DIFF, write=False)
    assert again.already_applied


def test_conflict_names_file_and_hunk(tmp_path):
    write(tmp_path, "abcdefgX")
    with pytest.raises(unidiff.HunkFailed, match=r"hunk #2 \(@@ -7,2 \+8,2 @@\) of f.py"):
        unidiff.apply(tmp_path, DIFF)


def test_creates_a_new_file_and_honours_missing_final_newline(tmp_path):
    diff = "--- /dev/null\n+++ b/pkg/new.py\n@@ -0,0 +1,2 @@\n+one\n+two\n\\ No newline at end of file\n"
    unidiff.apply(tmp_path, diff)
    assert (tmp_path / "pkg/new.py").read_text() == "one\ntwo"


@pytest.mark.parametrize("header, why", [
    ("b/{outside}", "not a file inside the tree"),  # b//tmp/x: an absolute path after the prefix
    ("b/../escaped.py", "not a file inside the tree"),
    ("f.py", "no a/ or b/ prefix"),
])
def test_a_patch_path_outside_the_tree_is_refused(tmp_path, header, why):
    """Patch targets stay under the tree: an absolute path after the prefix, `..`, or a path
    with no prefix (which raised IndexError) is refused naming the path, and nothing is written."""
    tree, outside = tmp_path / "tree", tmp_path / "outside.py"
    tree.mkdir()
    header = header.format(outside=outside)
    diff = f"--- /dev/null\n+++ {header}\n@@ -0,0 +1 @@\n+written\n"
    with pytest.raises(unidiff.HardenedError, match=why):
        unidiff.apply(tree, diff)
    assert not outside.exists() and not (tmp_path / "escaped.py").exists()
