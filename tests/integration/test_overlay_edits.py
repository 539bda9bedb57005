"""The CPU overlay's source edits (tests/cpu_overlay/edits.toml) apply wherever they are meant
to, or the environment's build fails naming the edit, the file and the build: an edit that
silently did not apply would strip the page ledger or the fault hooks from one build only."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from sglang_hardened.sandbox.env import Overlay, SandboxError, upstream_wheel
from tests.harness import REPO

OVERLAY = Overlay((REPO / "tests" / "cpu_overlay").resolve())


def _overlay(tmp_path: Path, edits: str) -> Overlay:
    root = tmp_path / "overlay"
    root.mkdir()
    (root / "edits.toml").write_text(edits)
    return Overlay(root)


def _site(tmp_path: Path, text: str) -> Path:
    target = tmp_path / "site" / "sglang" / "srt" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text(text)
    return tmp_path / "site"


EDIT = '''[[edit]]
file = "sglang/srt/x.py"
why = "the hook"
old = "def f():"
new = "def f():  # hooked"
'''


def test_an_edit_that_does_not_apply_fails_the_build_naming_it(tmp_path):
    site = _site(tmp_path, "def g():\n    pass\n")
    with pytest.raises(SandboxError, match=r"edit 'the hook' does not apply to sglang/srt/x.py in the build of w.whl: "
                                           r"its text is not there"):
        _overlay(tmp_path, EDIT).apply(site, "0.5.19", "the build of w.whl")
    assert (site / "sglang/srt/x.py").read_text() == "def g():\n    pass\n"


def test_an_edit_whose_file_is_missing_fails_the_build(tmp_path):
    site = _site(tmp_path, "")
    (site / "sglang/srt/x.py").unlink()
    with pytest.raises(SandboxError, match="no such file"):
        _overlay(tmp_path, EDIT).apply(site, "0.5.19", "b")


def test_an_edit_applies_only_to_the_bases_it_lists(tmp_path):
    overlay = _overlay(tmp_path, EDIT + 'bases = ["0.5.23"]\n')
    site = _site(tmp_path, "def g():\n")
    assert overlay.apply(site, "0.5.19", "b") == []
    with pytest.raises(SandboxError, match="does not apply"):
        overlay.apply(site, "0.5.23", "b")


def test_a_cached_build_missing_an_edit_meant_for_it_is_refused(tmp_path):
    overlay = _overlay(tmp_path, EDIT)
    site = _site(tmp_path, "def f():\n")
    applied = overlay.apply(site, "0.5.19", "b")
    overlay.check_applied(site, "0.5.19", "b", applied)
    with pytest.raises(SandboxError, match=r"b \(.*\) was built without overlay edits meant for it: .*the hook"):
        overlay.check_applied(site, "0.5.19", "b", [])


def _unpacked(wheel: Path, dest: Path) -> Path:
    """The wheel's files the overlay edits, as an environment holds them."""
    with zipfile.ZipFile(wheel) as zf:
        names = {e["file"] for e in OVERLAY.edits()} & set(zf.namelist())
        zf.extractall(dest, members=sorted(names))
    return dest


def test_every_sglang_edit_applies_to_every_build_it_is_meant_for(built, bases, tmp_path):
    """All five bases, upstream and hardened (the edits see each series' patched files)."""
    results, _ = built
    for base in bases:
        for build, wheel in (("upstream", upstream_wheel(base)), ("hardened", results[base].wheel)):
            site = _unpacked(wheel, tmp_path / f"{base}-{build}")
            applied = OVERLAY.apply(site, base, f"{base} {build}")
            assert applied and len(applied) == len(OVERLAY.meant_for(site, base)), (base, build)
