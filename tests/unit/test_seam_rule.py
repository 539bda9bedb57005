"""The seam rule's reading of a patch (pipeline/seams.py): one alias per runtime module, named
after its dotted path under runtime, and a runtime call told from glue by an alias its file
imported, not by a name that merely starts with "hardened"."""

from __future__ import annotations

from sglang_hardened.pipeline import seams
from sglang_hardened.runtime import release_guard


def _diff(path: str, *added: str) -> str:
    return f"--- a/{path}\n+++ b/{path}\n@@ -1,1 +1,{1 + len(added)} @@\n a\n" + "".join(f"+{a}\n" for a in added)


def test_the_alias_is_hardened_and_the_module_s_path_under_runtime_joined_by_underscores():
    assert seams.alias_for("nixl_drain") == "hardened_nixl_drain"
    assert seams.alias_for("page_tags.seams") == "hardened_page_tags_seams"
    assert release_guard.DRAIN_ALIAS == seams.alias_for("nixl_drain"), "H5 tells a NIXL backend by its import"


def test_an_import_under_any_other_alias_is_a_fault_naming_its_line_in_the_diff():
    diff = _diff("x.py",
                 "from sglang_hardened.runtime.page_tags import seams as hardened_page_tags_seams",
                 "from sglang_hardened.runtime.page_tags import nixl as hardened_tags  # H8",
                 "from sglang_hardened.runtime import nixl_drain",
                 "from sglang_hardened.runtime import startup as hardened_startup, outcomes as hardened_outcomes",
                 "import sglang_hardened.runtime.coverage")
    faults = seams.alias_faults(diff)
    assert [line for line, _ in faults] == [6, 7, 9]
    assert "hardened_page_tags_nixl" in faults[0][1] and "hardened_nixl_drain" in faults[1][1]
    assert "from sglang_hardened.runtime" in faults[2][1]


def test_a_call_is_a_seam_only_through_an_alias_its_file_imported():
    """A name that merely starts with "hardened_", or an alias another file imported, is glue."""
    diff = _diff("x.py",
                 "from sglang_hardened.runtime import startup as hardened_startup",
                 "if not hardened_startup.check(a,",
                 "        b):",
                 "    hardened_other.check(a)",
                 "x = self.hardened_startup.y") + _diff("y.py", "hardened_startup.check(a)")
    assert seams.glue_lines(diff) == {"x.py": ["hardened_other.check(a)", "x = self.hardened_startup.y"],
                                      "y.py": ["hardened_startup.check(a)"]}


def test_seams_name_a_dotted_module_and_a_later_patch_may_call_an_alias_an_earlier_one_imported():
    first = _diff("x.py", "from sglang_hardened.runtime.page_tags import seams as hardened_page_tags_seams",
                  "hardened_page_tags_seams.allocate(r)") + _diff(
        "y.py", "from sglang_hardened.runtime.page_tags import nixl as hardened_page_tags_nixl")
    later = _diff("x.py", "    if hardened_page_tags_seams.carried(r):") + _diff("y.py", "hardened_page_tags_nixl.carried(r)")
    assert seams.runtime_seams([("H8", first), ("H9", later)]) == {
        "page_tags.seams.allocate": {"H8"}, "page_tags.seams.carried": {"H9"}, "page_tags.nixl.carried": {"H9"}}


def test_a_hash_or_bracket_inside_a_string_leaves_no_call_open_and_the_glue_after_it_counts():
    glue = ["a = 1", "b = 2", 'c = "(" + "#"', "d = 4", "e = 5"]
    diff = _diff("x.py", "from sglang_hardened.runtime import metrics as hardened_metrics",
                 'hardened_metrics.note(f"request #{rid}")', *glue)
    assert seams.glue_lines(diff) == {"x.py": glue}


def test_a_line_is_a_seam_only_when_it_is_nothing_but_the_import_or_the_call():
    """A ``;`` hides glue beside an import or a call; a line that does not tokenize alone is glue."""
    diff = _diff("x.py", "x = glue(); from sglang_hardened.runtime import metrics as hardened_metrics",
                 "from sglang_hardened.runtime import startup as hardened_startup",
                 "hardened_startup.check(a); y = glue()", 's = """open')
    assert seams.glue_lines(diff) == {"x.py": [
        "x = glue(); from sglang_hardened.runtime import metrics as hardened_metrics",
        "hardened_startup.check(a); y = glue()", 's = """open']}


def test_only_a_runtime_module_that_exists_may_be_imported_and_the_layer_is_named_only_there():
    """A package, a function, a missing module or another library under a ``hardened_`` alias, or a
    line that names the layer other than in the one import, is a fault naming its line."""
    diff = _diff("x.py",
                 "from sglang_hardened.runtime.page_tags import seams as hardened_page_tags_seams",
                 "from sglang_hardened.runtime import page_tags as hardened_page_tags",
                 "from sglang_hardened.runtime.coverage import stamp as hardened_coverage_stamp",
                 "from sglang_hardened.runtime import nowhere as hardened_nowhere",
                 "import os as hardened_os",
                 "x = glue(); from sglang_hardened.runtime import metrics as hardened_metrics",
                 "sglang_hardened.runtime.metrics.note(r)",
                 'importlib.import_module("sglang_hardened.runtime.metrics")',
                 "a = 1  # sglang_hardened in a comment is no fault")
    faults = seams.alias_faults(diff)
    assert [line for line, _ in faults] == [6, 7, 8, 9, 10, 11, 12]
    assert "page_tags" in faults[0][1] and "coverage.stamp" in faults[1][1] and "nowhere" in faults[2][1]


def test_a_package_imported_under_its_alias_calls_nothing():
    diff = _diff("x.py", "from sglang_hardened.runtime import page_tags as hardened_page_tags",
                 "hardened_page_tags.seams.allocate(r)")
    assert seams.runtime_seams([("H8", diff)]) == {}
