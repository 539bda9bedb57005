"""The lock (patches/upstream.lock) pins every wheel upstream ships per base, reference first, and
refuses a lock that would make the build harden the wrong file; verify's check that a base's
wheels share their Python sources, on wheels made here."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from sglang_hardened.common.errors import HardenedError
from sglang_hardened.pipeline.lock import LOCK_NAME, UpstreamPin, get_wheels, load_lock, load_wheels, lock_block
from sglang_hardened.pipeline.verify import same_sources

REF = UpstreamPin("0.5.23", "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl", "a" * 64)
ARM = UpstreamPin("0.5.23", "sglang-0.5.23-cp312-cp312-manylinux_2_34_aarch64.whl", "b" * 64)


def lock(tmp_path: Path, text: str) -> Path:
    (tmp_path / LOCK_NAME).write_text(text)
    return tmp_path


def test_the_shipped_lock_pins_every_cpython_and_both_architectures_per_base(patches):
    for base, pins in load_wheels(patches).items():
        assert (pins[0].python, pins[0].arch) == ("cp311", "x86_64"), base  # the reference: what the sandbox runs
        pythons = {p.python for p in pins}
        assert {(py, arch) for py in pythons for arch in ("x86_64", "aarch64")} == {(p.python, p.arch) for p in pins}
        assert {"cp311", "cp312", "cp313"} <= pythons, base


def test_a_block_written_for_a_base_reads_back_reference_first(tmp_path):
    patches = lock(tmp_path, lock_block([REF, ARM]))
    assert load_wheels(patches) == {"0.5.23": [REF, ARM]}
    assert load_lock(patches) == {"0.5.23": REF}
    assert (ARM.python, ARM.arch) == ("cp312", "aarch64")


@pytest.mark.parametrize("text,error", [
    (lock_block([REF, REF]), "two wheels for one Python and architecture"),
    (lock_block([REF]).replace("sglang-0.5.23-", "sglang-0.5.22-"), "a wheel of sglang 0.5.22"),
    (lock_block([REF]).replace(".whl", ".tar.gz"), "base 0.5.23"),
    ('[base."0.5.23"]\nfile = "x"\n', "lacks sha256"),
])
def test_a_lock_that_would_harden_another_file_is_refused_naming_it(tmp_path, text, error):
    with pytest.raises(HardenedError, match=error):
        load_wheels(lock(tmp_path, text))


def test_an_unknown_base_names_the_supported_ones(tmp_path):
    with pytest.raises(HardenedError, match="supported bases: 0.5.23"):
        get_wheels(lock(tmp_path, lock_block([REF])), "0.5.24")


def wheel(path: Path, sources: dict[str, str]) -> Path:
    """A wheel holding only a RECORD that lists ``sources`` (name -> hash) and a .so."""
    rows = "".join(f"{name},{digest},1\n" for name, digest in sources.items())
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("sglang-0.5.23.dist-info/RECORD", rows + f"sglang/_ext.{path.stem}.so,sha256=x,1\n")
    return path


def test_wheels_with_thesame_sources_pass_and_one_that_differs_is_named(tmp_path):
    same = {"sglang/a.py": "sha256=1", "sglang/b.py": "sha256=2"}
    ref, arm = wheel(tmp_path / "ref.whl", same), wheel(tmp_path / "arm.whl", same)
    assert same_sources([REF, ARM], [ref, arm]) == "ok (identical)"
    odd = wheel(tmp_path / "odd.whl", {**same, "sglang/b.py": "sha256=3"})
    assert same_sources([REF, ARM], [ref, odd]) == (f"FAILED: {ARM.file} differs from {REF.file} in 1 sources: "
                                                     "sglang/b.py")
