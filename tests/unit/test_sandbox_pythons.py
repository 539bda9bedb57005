"""The sandbox under another Python than 3.11: which interpreter it finds, which pins it installs
(torch's CUDA build and its libraries where no CPU build is served), which upstream wheel it
runs, and the clear errors for a Python it cannot run."""

from __future__ import annotations

import platform
import sys

import pytest
from click.testing import CliRunner

from sglang_hardened.cli import main
from sglang_hardened.common.errors import HardenedError
from sglang_hardened.common.pythons import interpreter, runs_on, this_version
from sglang_hardened.pipeline.lock import get_wheels, pin_for
from sglang_hardened.sandbox.env import PINS, PYTHONS, SandboxError, build_env, common_pins, default_overlay


def pins_of(text: str) -> dict[str, str]:
    """name -> pin line, for every pin of a pins text (comments dropped)."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return {line.split("==")[0].lower().replace("_", "-"): line for line in lines if line}


def test_python_311_installs_common_txt_as_it_is():
    assert common_pins("3.11") == (PINS / "common.txt").read_text()


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_later_pythons_get_pypis_cuda_torch_with_its_libraries_and_nothing_pinned_twice(python):
    text = common_pins(python)
    pins = pins_of(text)
    assert pins["torch"] == "torch==2.13.0" and pins["triton"] == "triton==3.7.1"
    assert {"nvidia-cudnn-cu13", "nvidia-cublas", "cuda-bindings", "setuptools"} <= pins.keys()
    assert len(pins) == len([line for line in text.splitlines() if line.split("#", 1)[0].strip()]), "a name pinned twice"
    assert {k: v for k, v in pins_of((PINS / "common.txt").read_text()).items() if k not in ("torch", "triton")}.items() \
        <= pins.items(), "every other pin as common.txt has it"


def test_an_unknown_python_is_refused_naming_those_the_sandbox_runs():
    with pytest.raises(SandboxError, match=r"runs Python 3\.11, 3\.12, 3\.13, not '3\.9'"):
        common_pins("3.9")
    with pytest.raises(SandboxError, match="not '3.9'"):
        build_env("0.5.23", [], default_overlay(), "3.9")


def test_a_wheel_for_another_cpython_is_refused_before_pip_runs(tmp_path):
    wheel = tmp_path / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    wheel.write_bytes(b"")
    with pytest.raises(SandboxError, match=r"built for cp311, not the environment's Python 3\.12"):
        build_env("0.5.23", [wheel], default_overlay(), "3.12")


def test_each_python_the_sandbox_runs_has_an_upstream_wheel_for_this_machine_on_every_base(patches):
    for base in ("0.5.19", "0.5.23"):
        for python in PYTHONS:
            assert pin_for(get_wheels(patches, base), runs_on(python)).python == f"cp{python.replace('.', '')}"
    with pytest.raises(HardenedError, match=r"no sglang 0\.5\.23 wheel for cp310 x86_64 \(it ships: cp311 x86_64, "):
        pin_for(get_wheels(patches, "0.5.23"), "cp310 x86_64")


def test_runs_on_is_what_a_server_of_that_python_reports():
    assert runs_on("3.12") == f"cp312 {platform.machine()}"


def test_this_python_is_found_as_itself():
    assert interpreter(this_version()) == sys.executable


def test_pyenvs_newest_of_a_version_is_found_before_path(tmp_path, monkeypatch):
    """pyenv's shims fail from a subprocess, so its versions folder is read directly."""
    for version in ("3.12.9", "3.12.10", "3.13.0"):
        exe = tmp_path / "versions" / version / "bin" / f"python{version[:4]}"
        exe.parent.mkdir(parents=True)
        exe.touch(mode=0o755)
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    assert interpreter("3.12") == str(tmp_path / "versions" / "3.12.10" / "bin" / "python3.12")


def test_an_absent_python_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HardenedError, match=r"python3\.99 is needed .*`pyenv install 3\.99`"):
        interpreter("3.99")
    with pytest.raises(HardenedError, match="major.minor"):
        interpreter("3.12.1")


def test_sandbox_up_offers_the_pythons_it_runs_and_refuses_another():
    runner = CliRunner()
    helped = runner.invoke(main, ["sandbox", "up", "--help"])
    assert "--python [3.11|3.12|3.13]" in helped.output and "--hardened --python 3.12" in helped.output
    refused = runner.invoke(main, ["sandbox", "up", "--base", "0.5.23", "--python", "3.10"])
    assert refused.exit_code == 2 and "'3.10' is not one of '3.11', '3.12', '3.13'" in refused.output
