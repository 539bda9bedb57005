"""Each file the build changes says so at its top (Apache-2.0 section 4(b)), below the lines
that must stay first; the built wheels are checked in tests/integration/test_build.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hardened.common.errors import HardenedError
from sglang_hardened.pipeline.series import Patch, Series
from sglang_hardened.pipeline.stamp import (VERSION_FILE, VERSION_STAMP, change_notice, changes, notice_line,
                                            stamp_change_notices)
from sglang_hardened.pipeline.wheelfile import WheelTree


def _patch(name: str, *files: tuple[str, str]) -> Patch:
    diff = "".join(f"--- {old}\n+++ {new}\n@@ -1 +1 @@\n-a\n+b\n" for old, new in files)
    return Patch(Path(name), {}, diff)


@pytest.mark.parametrize(("head", "at"), [
    ([], 0),
    (["import os\n"], 0),
    (["#!/usr/bin/env python\n", "import os\n"], 1),
    (["# -*- coding: utf-8 -*-\n", "import os\n"], 1),
    (["#!/usr/bin/env python\n", "# vim: set fileencoding=latin-1 :\n", "x = 1\n"], 2),
    (["# a comment\n", "# coding=utf-8\n"], 2),
    (["x = 1\n", "y = 2\n", "# coding: utf-8\n"], 0),  # past line 2 it is a comment like any
])
def test_the_notice_goes_first_but_below_a_shebang_or_encoding_line(head, at):
    assert notice_line(head) == at


def test_a_file_names_every_patch_that_changed_it_in_order_and_a_deleted_one_nothing():
    series = Series("0.5.23", Path("."), 1, (
        _patch("0001-a.patch", ("a/x.py", "b/x.py"), ("a/gone.py", "b/gone.py")),
        _patch("0002-b.patch", ("/dev/null", "b/new.py"), ("a/x.py", "b/x.py"), ("a/gone.py", "/dev/null")),
    ))
    assert changes(series) == {"x.py": ["0001-a.patch", "0002-b.patch"], "new.py": ["0002-b.patch"],
                               VERSION_FILE: [VERSION_STAMP]}


def test_stamping_puts_the_notice_in_and_refuses_a_file_that_cannot_carry_it(tmp_path):
    (tmp_path / "x.py").write_text("#!/bin/python\nprint(1)\n")
    stamp_change_notices(WheelTree(tmp_path), {"x.py": ["0001-a.patch"]})
    assert (tmp_path / "x.py").read_text() == "#!/bin/python\n" + change_notice(["0001-a.patch"]) + "print(1)\n"
    with pytest.raises(HardenedError, match="data.json"):
        stamp_change_notices(WheelTree(tmp_path), {"data.json": ["0001-a.patch"]})
