"""Bad input stops the build with a message naming the cause and leaves no output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_hardened.common.knobs import CACHE
from sglang_hardened.pipeline.fetch import cached_path, fetch_wheel
from sglang_hardened.pipeline.lock import load_lock

BASE = "0.5.19"
PATCH = "0001-h0-report-hardened-identity.patch"


def assert_failed_cleanly(done, out: Path, *needles: str) -> None:
    assert done.returncode != 0
    for needle in needles:
        assert needle in done.stderr, done.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_tampered_cached_upstream_wheel_is_refused(run_cli, patches, tmp_path):
    pin = load_lock(patches)[BASE]
    cache = tmp_path / "cache"
    tampered = cached_path(pin, cache)
    tampered.parent.mkdir(parents=True)
    shutil.copy(fetch_wheel(pin), tampered)  # fetched here: no earlier test need have
    with tampered.open("r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    done = run_cli("build", "--base", BASE, "--out", str(out), env={CACHE.name: str(cache)})
    assert_failed_cleanly(done, out, "sha256 mismatch", pin.sha256)


def test_hunk_that_no_longer_applies_names_patch_and_hunk(run_cli, tree_copy, tmp_path):
    patch = tree_copy / BASE / PATCH
    text = patch.read_text()
    assert ' "internal_states": internal_states,\n' in text
    patch.write_text(text.replace(' "internal_states": internal_states,\n',
                                  ' "internal_states": internal_states_renamed,\n'))
    out = tmp_path / "out"
    done = run_cli("build", "--base", BASE, "--out", str(out))
    assert_failed_cleanly(done, out, PATCH, "hunk #2", "sglang/srt/entrypoints/http_server.py")
    verify = run_cli("verify", "--base", BASE)
    assert verify.returncode != 0 and "hunk #2" in verify.stdout


def test_series_naming_a_missing_file(run_cli, tree_copy, tmp_path):
    with (tree_copy / BASE / "series").open("a") as fh:
        fh.write("0002-not-there.patch\n")
    out = tmp_path / "out"
    assert_failed_cleanly(run_cli("build", "--base", BASE, "--out", str(out)), out,
                          "missing patch file", "0002-not-there.patch")


def test_patch_file_not_in_the_series(run_cli, tree_copy, tmp_path):
    shutil.copy(tree_copy / BASE / PATCH, tree_copy / BASE / "0002-stray.patch")
    out = tmp_path / "out"
    assert_failed_cleanly(run_cli("build", "--base", BASE, "--out", str(out)), out,
                          "not in the series", "0002-stray.patch")


@pytest.mark.parametrize("field", ["Hardening-Id", "Description", "Origin", "Last-Update"])
def test_header_missing_a_required_field(run_cli, tree_copy, tmp_path, field):
    patch = tree_copy / BASE / PATCH
    lines = patch.read_text().splitlines(keepends=True)
    patch.write_text("".join(line for line in lines if not line.startswith(f"{field}:")))
    out = tmp_path / "out"
    assert_failed_cleanly(run_cli("build", "--base", BASE, "--out", str(out)), out,
                          PATCH, field)


def test_unknown_base(run_cli, tmp_path):
    out = tmp_path / "out"
    assert_failed_cleanly(run_cli("build", "--base", "0.4.0", "--out", str(out)), out,
                          "unknown base '0.4.0'", "0.5.19")


def test_output_dir_that_is_not_writable(run_cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "out"
    done = run_cli("build", "--base", BASE, "--out", str(out))
    assert done.returncode != 0 and "is not writable" in done.stderr and str(out) in done.stderr
    assert blocker.read_text() == "not a directory"


def test_failure_in_a_later_base_leaves_no_earlier_output(run_cli, tree_copy, drop_base, tmp_path):
    for base in list(load_lock(tree_copy))[:-2]:  # one earlier base shows it: no need to build four
        drop_base(base)
    patch = tree_copy / "0.5.23" / PATCH
    patch.write_text(patch.read_text().replace(" from sglang.version import __version__\n",
                                               " from sglang.version import version_gone\n"))
    out = tmp_path / "out"
    done = run_cli("build", "--all", "--python", "3.11", "--arch", "x86_64", "--out", str(out))  # a wheel a base
    assert_failed_cleanly(done, out, "base 0.5.23", PATCH, "hunk #1")
    assert "0.5.22: wrote" in done.stderr  # earlier bases were built, then discarded
