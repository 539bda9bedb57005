"""Build hardened wheels: pinned upstream wheel → apply series → stamp → repack.

All outputs of one call appear together or not at all: they are built in a
staging directory inside the output directory and moved in at the end.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .. import __version__
from ..common.errors import HardenedError
from ..common.hashing import files_digest
from ..common.paths import patches_dir
from . import unidiff
from .fetch import fetch_wheel
from .lock import LOCK_NAME, UpstreamPin, get_wheels
from .manifest import build_manifest, write_manifest
from .sbom import write_sbom
from .series import Series, load_series
from .stamp import changes, hardened_version, stamp_change_notices, stamp_metadata, stamp_version_module
from .wheelfile import ZIP_EPOCH_MIN, WheelTree, unpacked

Progress = Callable[[str], None]
TOOL_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BuildResult:
    base: str
    version: str
    wheel: Path
    manifest: dict


def source_date_epoch(series: Series) -> int:
    """SOURCE_DATE_EPOCH if set, else the series' newest Last-Update (midnight UTC)."""
    if env := os.environ.get("SOURCE_DATE_EPOCH"):
        return int(env)
    day = series.last_update
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp())


def apply_series(tree: WheelTree, series: Series, on_patch: Progress | None = None) -> None:
    """Apply each patch in order; a hunk that does not fit stops with patch and hunk named."""
    for patch in series.patches:
        try:
            results = unidiff.apply(tree.root, patch.diff)
        except HardenedError as exc:
            raise HardenedError(f"base {series.base}: patch {patch.name}: {exc}") from exc
        stale = [r.file for r in results if r.already_applied]
        if stale:
            raise HardenedError(
                f"base {series.base}: patch {patch.name}: already applied in {', '.join(stale)} "
                "(upstream has it: drop it from the series)"
            )
        if on_patch:
            on_patch(patch.name)


def _check_writable(out_dir: Path) -> None:
    """Fail before any work if the output directory cannot take files (root ignores modes)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        raise HardenedError(f"output directory {out_dir} is not writable: {exc.strerror or exc}") from exc


def build_one(pin: UpstreamPin, series: Series, upstream: Path, dest_dir: Path,
              progress: Progress) -> BuildResult:
    """Build one base's hardened wheel into `dest_dir`."""
    version = hardened_version(series.base, series.revision)
    epoch = source_date_epoch(series)
    manifest = build_manifest(pin, series, version)
    with unpacked(upstream, workdir=dest_dir) as tree:
        progress(f"{series.base}: unpacked {upstream.name}")
        apply_series(tree, series, lambda name: progress(f"{series.base}: applied {name}"))
        stamp_version_module(tree, series.base, version)
        stamp_change_notices(tree, changes(series))
        stamp_metadata(tree, series.base, version, __version__)
        write_manifest(tree, manifest)
        write_sbom(tree, manifest, epoch)
        wheel = dest_dir / upstream.name.replace(f"sglang-{series.base}-", f"sglang-{version}-", 1)
        tree.pack(wheel, epoch)
    progress(f"{series.base}: wrote {wheel.name}")
    return BuildResult(series.base, version, wheel, manifest)


def build_tool_wheel(dest_dir: Path) -> Path:
    """The sglang-hardened wheel itself, so the hardened sglang's dependency resolves.

    Its timestamp does not depend on which bases were built in the same call.
    """
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", ZIP_EPOCH_MIN))
    if not (TOOL_ROOT / "pyproject.toml").is_file():
        raise HardenedError(f"no sglang-hardened source tree at {TOOL_ROOT}: build from a checkout")
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".tool-") as tmp:
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(epoch))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
               "-q", "-w", tmp, str(TOOL_ROOT)]
        run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = list(Path(tmp).glob("sglang_hardened-*.whl"))
        if run.returncode != 0 or len(wheels) != 1:
            raise HardenedError(f"building the sglang-hardened wheel failed:\n{run.stdout[-2000:]}")
        target = dest_dir / wheels[0].name
        os.replace(wheels[0], target)
    return target


def tool_sources() -> list[Path]:
    """The files of this checkout's ``sglang_hardened`` package: what the tool wheel packs."""
    return [p for p in (TOOL_ROOT / "sglang_hardened").rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def inputs_digest(patches: Path, base: str) -> str:
    """What ``build([base])`` reads, as one hash: the lock, the base's series and patches, and the
    tool's own source (its wheel, and the code that builds). Builds are reproducible, so equal
    inputs give equal wheels, and a cache keyed on this skips the build."""
    tool = [*tool_sources(), *(TOOL_ROOT / name for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE"))]
    patch_files = [patches / LOCK_NAME, *(p for p in (patches / base).rglob("*") if p.is_file())]
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    return hashlib.sha256(f"{files_digest(TOOL_ROOT, tool)} {files_digest(patches, patch_files)} {epoch}".encode()).hexdigest()


Choose = Callable[[list[UpstreamPin]], list[UpstreamPin]]


def reference(wheels: list[UpstreamPin]) -> list[UpstreamPin]:
    """The wheel the sandbox and the tests run (cp311 x86_64): one build per base."""
    return wheels[:1]


def every(wheels: list[UpstreamPin]) -> list[UpstreamPin]:
    """Every wheel upstream ships for the base: each CPython, each architecture."""
    return wheels


def build(bases: list[str], out_dir: Path, *, patches: Path | None = None,
          progress: Progress = lambda msg: None, choose: Choose = reference) -> tuple[list[BuildResult], Path]:
    """Build the wheels `choose` takes of each base in `bases`, plus the tool wheel, into
    `out_dir`, all or nothing. Every wheel of a base comes from the same series: the patches
    touch only Python sources, which all of upstream's wheels of a release share."""
    patches = patches or patches_dir()
    plan = []
    for base in bases:
        pinned = get_wheels(patches, base)
        chosen = choose(pinned)
        if not chosen:
            raise HardenedError(f"base {base} has no pinned wheel of the Python and machine asked for "
                                f"(it pins: {', '.join(f'{p.python} {p.arch}' for p in pinned)})")
        plan += [(pin, load_series(patches, base)) for pin in chosen]
    _check_writable(out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".staging-") as tmp:
        staging = Path(tmp)
        results = []
        for pin, series in plan:
            upstream = fetch_wheel(pin, quiet=False)
            results.append(build_one(pin, series, upstream, staging, progress))
        tool = build_tool_wheel(staging)
        progress(f"tool: wrote {tool.name}")
        final = [replace(r, wheel=out_dir / r.wheel.name) for r in results]
        for staged, result in zip(results, final):
            os.replace(staged.wheel, result.wheel)
        tool_final = out_dir / tool.name
        os.replace(tool, tool_final)
    return final, tool_final
