"""The build pipeline on the real pinned upstream wheels, every base."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from sglang_hardened.common.hashing import record_digest, sha256_file
from sglang_hardened.pipeline import unidiff
from sglang_hardened.pipeline.build import build, every
from sglang_hardened.pipeline.fetch import cached_path
from sglang_hardened.pipeline.lock import get_wheels, load_lock
from sglang_hardened.pipeline.seams import added_runs
from sglang_hardened.pipeline.sbom import SBOM_FILE
from sglang_hardened.pipeline.series import load_series
from sglang_hardened.pipeline.stamp import VERSION_FILE, VERSION_STAMP, change_notice, hardened_version, notice_line
from sglang_hardened.pipeline.wheelfile import python_sources, record_entries
from sglang_hardened.runtime.identity import MANIFEST_NAME
from tests.harness import REPO

# Read inside the venv without importing sglang's package __init__ (it needs
# torch and the CUDA stack; the e2e harness checks `sglang.__version__` there).
PROBE = """
import importlib.metadata as md, importlib.util, json, pathlib, py_compile, sys
from sglang_hardened.runtime import identity
pkg = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
spec = importlib.util.spec_from_file_location("v", pkg / "_version.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
patched = {name: pkg.parent / name for name in json.loads(sys.argv[1])}
for path in patched.values():
    py_compile.compile(str(path), doraise=True)
print(json.dumps({
    "dist_version": md.version("sglang"),
    "module_version": mod.__version__,
    "patched": {name: path.read_text() for name, path in patched.items()},
    "startup_line": identity.startup_line(),
    "server_info": identity.server_info(),
    "sbom": md.distribution("sglang").read_text("sboms/sglang-hardened.cdx.json"),
}))
"""


# The newest base installs in the gate; the others in the full run (the same code, another wheel).
BASES = list(load_lock(REPO / "patches"))


@pytest.mark.parametrize("base", [pytest.param(b, marks=() if b == BASES[-1] else pytest.mark.full) for b in BASES])
def test_hardened_wheel_installs_and_says_what_it_carries(base, built, patches, tmp_path, make_venv):
    results, tool = built
    result = results[base]
    series = load_series(patches, base)
    pin = load_lock(patches)[base]
    python = make_venv(tmp_path / "venv", result.wheel, tool)

    touched = {fp.target: fp for p in series.patches for fp in unidiff.parse(p.diff)}
    probe = json.loads(subprocess.run([str(python), "-c", PROBE, json.dumps(sorted(touched))],
                                      check=True, capture_output=True, text=True).stdout)
    version = f"{base}+hardened.{series.revision}"
    assert probe["dist_version"] == version
    assert probe["module_version"] == version
    for patch in series.patches:  # every seam each patch adds is in the installed file (a later
        for fp in unidiff.parse(patch.diff):  # patch may add lines beside it: its context may change)
            for hunk in fp.hunks:
                for block in map("".join, added_runs(hunk)):
                    assert block in probe["patched"][fp.target], (patch.name, hunk.header, block)
    assert probe["server_info"]["hardening_ids"] == series.hardening_ids
    assert probe["server_info"]["deferred_decode_kv_release"] is True  # on by default on every base
    assert "H0" in probe["startup_line"] and version in probe["startup_line"]

    info = subprocess.run([str(python.parent / "sglang-hardened"), "info", "--json"],
                          check=True, capture_output=True, text=True)
    manifest = json.loads(info.stdout)
    # a source tree on the path (an editable install's, as upstream's image keeps) shadows the wheel
    (tmp_path / "src" / "sglang").mkdir(parents=True)
    (tmp_path / "src" / "sglang" / "__init__.py").write_text("")
    shadowed = subprocess.run([str(python.parent / "sglang-hardened"), "info"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(tmp_path / "src")})
    assert shadowed.returncode != 0, shadowed.stdout
    assert f"imports sglang from {tmp_path / 'src' / 'sglang' / '__init__.py'}" in shadowed.stderr, shadowed.stderr
    assert manifest["upstream"] == {"file": pin.file, "sha256": pin.sha256}
    assert "H0" in manifest["hardening_ids"]
    assert [(p["name"], p["sha256"], p["hardening_id"]) for p in manifest["patches"]] == [
        (p.name, sha256_file(p.path), p.hardening_id) for p in series.patches
    ]

    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(probe["sbom"])
    assert errors is None, errors
    sbom = json.loads(probe["sbom"])
    ancestor = sbom["metadata"]["component"]["pedigree"]["ancestors"][0]
    assert ancestor["hashes"] == [{"alg": "SHA-256", "content": pin.sha256}]
    assert {c["name"] for c in sbom["components"]} == {p.name for p in series.patches}


def test_wheel_metadata_requires_the_runtime_layer_and_drops_nothing(built, patches):
    results, _ = built
    result = results["0.5.23"]
    pin = load_lock(patches)["0.5.23"]

    with zipfile.ZipFile(result.wheel) as hardened, zipfile.ZipFile(cached_path(pin)) as upstream:
        dist = f"sglang-{result.version}.dist-info/"
        metadata = hardened.read(dist + "METADATA").decode()
        assert f"Version: {result.version}\n" in metadata
        assert "Requires-Dist: sglang-hardened==" in metadata
        upstream_payload = {n for n in upstream.namelist() if ".dist-info/" not in n and not n.endswith("/")}
        hardened_payload = {n for n in hardened.namelist() if ".dist-info/" not in n}
        assert upstream_payload == hardened_payload
        assert hardened.namelist()[-1] == dist + "RECORD"
        assert hardened.testzip() is None


def test_the_wheels_carry_the_licences_and_every_changed_file_says_what_changed_it(built, patches):
    """Apache-2.0: SGLang's licence stays in each hardened wheel; each file the build changed
    starts (below a shebang or encoding line) with a notice naming the patches, in RECORD as
    it is; the tool wheel carries the project's LICENSE and NOTICE, which names where a hardened
    wheel lists its changes."""
    results, tool = built
    for base, result in results.items():
        series = load_series(patches, base)
        by_file: dict[str, list[str]] = {}
        for patch in series.patches:
            for target in {fp.target for fp in unidiff.parse(patch.diff)}:
                by_file.setdefault(target, []).append(patch.name)
        by_file.setdefault(VERSION_FILE, []).append(VERSION_STAMP)
        record = record_entries(result.wheel)
        with zipfile.ZipFile(result.wheel) as hardened, zipfile.ZipFile(cached_path(load_lock(patches)[base])) as upstream:
            licence = upstream.read(f"sglang-{base}.dist-info/licenses/LICENSE")
            assert hardened.read(f"sglang-{result.version}.dist-info/licenses/LICENSE") == licence
            for name, by in by_file.items():
                data = hardened.read(name)
                lines = data.decode().splitlines(keepends=True)
                assert lines[notice_line(lines)] == change_notice(by), (base, name, lines[:3])
                assert record[name] == record_digest(data), (base, name)
    with zipfile.ZipFile(tool) as zf:
        dist = tool.name.split("-py3")[0] + ".dist-info"
        for name in ("LICENSE", "NOTICE"):
            assert zf.read(f"{dist}/licenses/{name}") == (REPO / name).read_bytes(), name
        metadata = zf.read(f"{dist}/METADATA").decode()
        assert "License-Expression: Apache-2.0\n" in metadata and "License-File: NOTICE\n" in metadata
    notice = (REPO / "NOTICE").read_text()
    assert MANIFEST_NAME in notice and SBOM_FILE in notice


def test_two_builds_are_byte_identical(built, tmp_path):
    results, tool = built
    again, tool_again = build(["0.5.19"], tmp_path / "again")
    assert sha256_file(again[0].wheel) == sha256_file(results["0.5.19"].wheel)
    assert sha256_file(tool_again) == sha256_file(tool)


def test_every_wheel_upstream_ships_is_hardened_alike_and_reproducibly(patches, tmp_path):
    """One hardened wheel per upstream wheel of the base (each CPython, x86_64 and aarch64; an
    aarch64 one too, which cannot run here): each named and tagged as its upstream wheel, with
    its own manifest, SBOM and RECORD, the same version and the same patched sources."""
    base = BASES[-1]
    pins = get_wheels(patches, base)
    assert {p.arch for p in pins} == {"x86_64", "aarch64"} and len({p.python for p in pins}) >= 3
    results, _ = build([base], tmp_path / "all", choose=every)
    assert [r.manifest["upstream"] for r in results] == [{"file": p.file, "sha256": p.sha256} for p in pins]
    assert {r.version for r in results} == {hardened_version(base, load_series(patches, base).revision)}
    sources = []
    for pin, result in zip(pins, results):
        assert result.wheel.name == pin.file.replace(f"sglang-{base}-", f"sglang-{result.version}-")
        with zipfile.ZipFile(result.wheel) as zf:
            assert zf.testzip() is None
            dist = f"sglang-{result.version}.dist-info/"
            assert f"Tag: {pin.python}-{pin.python}-" in zf.read(dist + "WHEEL").decode()
            sbom = json.loads(zf.read(dist + SBOM_FILE))
            assert sbom["metadata"]["component"]["pedigree"]["ancestors"][0]["hashes"][0]["content"] == pin.sha256
        sources.append(python_sources(result.wheel))
    assert all(s == sources[0] for s in sources), "the wheels' patched sources differ"
    arm = next(i for i, p in enumerate(pins) if p.arch == "aarch64")
    again, _ = build([base], tmp_path / "again", choose=lambda wheels: [wheels[arm]])
    assert sha256_file(again[0].wheel) == sha256_file(results[arm].wheel)


def test_verify_all_passes_on_the_shipped_series_and_docs_seams_md_is_its_index(run_cli, tmp_path):
    done = run_cli("verify", "--all", "--seams-index", str(tmp_path / "seams.md"))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("0.5.")]
    assert len(rows) >= 5 and all(" ok" in row for row in rows)
    assert (tmp_path / "seams.md").read_text() == (REPO / "docs" / "seams.md").read_text(), \
        "docs/seams.md is not current: sglang-hardened verify --all --seams-index docs/seams.md"
