"""Rules about the patches that code checks: the seam rule (verify), one patch saying
the same thing on every base, and each patch saying why it was not sent upstream."""

from __future__ import annotations

import re
from collections import defaultdict

from sglang_hardened.pipeline import seams
from sglang_hardened.pipeline.series import load_series

# DEP-3's Forwarded: where it went, or `no` / `not-needed` and, on the same line, why
FORWARDED = re.compile(r"https?://\S+|(?:no|not-needed), \S.{9,}")

SEAM = '''--- a/sglang/srt/x.py
+++ b/sglang/srt/x.py
@@ -1,3 +1,13 @@
+from sglang_hardened.runtime import startup as hardened_startup
+
 def f(a):
+    if not hardened_startup.check(
+        a,
+        b,
+    ):
+        return False
+    # a comment is not glue
+    a = a + 1  # sglang-hardened: a comment naming the layer makes no line a seam
+    a.hardened = True
     return a
 
'''


def test_a_runtime_call_and_its_arguments_are_seam_and_the_rest_is_glue():
    assert seams.glue_lines(SEAM) == {"sglang/srt/x.py": [
        "return False", "a = a + 1  # sglang-hardened: a comment naming the layer makes no line a seam",
        "a.hardened = True"]}


def test_verify_fails_a_vendor_patch_with_logic_in_upstream_files(run_cli, tree_copy):
    """0020 backports upstream's index-batch split to 0.5.19 (28 lines of upstream's own code):
    labelled a vendor patch, it breaks the seam rule."""
    patch = tree_copy / "0.5.19" / "0020-h6-backport-mooncake-transfer-batch-indices.patch"
    text = patch.read_text()
    patch.write_text(re.sub(r"^Origin: backport.*$", "Origin: vendor", text, count=1, flags=re.M))
    done = run_cli("verify", "--base", "0.5.19")
    assert done.returncode != 0, done.stdout
    [row] = [line for line in done.stdout.splitlines() if patch.name in line]
    assert "FAILED: more than the seam rule allows" in row and "sglang/srt/disaggregation/mooncake/conn.py" in row


def test_verify_fails_a_patch_that_imports_a_runtime_module_under_another_alias(run_cli, tree_copy):
    """One alias per runtime module (``hardened_<module>``): an import under another name fails
    its patch, naming the patch's line, even where the glue it leaves is within the budget."""
    patch = tree_copy / "0.5.19" / "0011-h8-page-tags-nixl.patch"
    text = patch.read_text()
    old = "from sglang_hardened.runtime.page_tags import nixl as hardened_page_tags_nixl"
    line = 1 + text.splitlines().index(f"+{old}")
    patch.write_text(text.replace(old, old.replace("hardened_page_tags_nixl", "hardened_tags")).replace(
        "hardened_page_tags_nixl.", "hardened_tags."))
    done = run_cli("verify", "--base", "0.5.19")
    assert done.returncode != 0, done.stdout
    [row] = [row for row in done.stdout.splitlines() if patch.name in row]
    assert f"FAILED: an import breaks the seam rule's one alias per module: line {line}:" in row, row
    assert "must be imported as hardened_page_tags_nixl" in row, row


def _norm(text: str) -> str:
    return " ".join(text.split())


def test_a_patch_says_the_same_on_every_base_unless_it_declares_a_variant(patches, bases):
    """Headers agree across bases but for Last-Update; a Description that differs (beyond its
    wrapping) is declared by a Variant header on every base's copy."""
    copies = defaultdict(dict)
    for base in bases:
        for p in load_series(patches, base).patches:
            copies[p.name][base] = p.headers
    for name, by_base in copies.items():
        fixed = {b: {k: v for k, v in h.items() if k not in ("Last-Update", "Description", "Variant")}
                 for b, h in by_base.items()}
        assert len({repr(sorted(f.items())) for f in fixed.values()}) == 1, (name, fixed)
        descriptions = {_norm(h["Description"]) for h in by_base.values()}
        if len(descriptions) > 1:
            undeclared = [b for b, h in by_base.items() if not h.get("Variant")]
            assert not undeclared, f"{name}: its description differs across bases; declare a Variant on {undeclared}"


def test_every_patch_says_why_it_was_not_forwarded(patches, bases):
    bare = [f"{base}/{p.name}: Forwarded: {p.headers['Forwarded']}"
            for base in bases for p in load_series(patches, base).patches
            if not FORWARDED.fullmatch(p.headers["Forwarded"])]
    assert not bare, "\n".join(bare)
