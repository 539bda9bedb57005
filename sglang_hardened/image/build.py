"""Build the hardened image from the repository's Dockerfile with Docker or buildah.

The build args (version, hardening ids, upstream hash) are read from the
manifest inside the hardened wheel, so the image says exactly what the wheel
carries. That wheel is the one for the base image's Python and machine (read
from the base image itself). The build context holds only the two wheels, and
the Dockerfile installs them offline. Beside the wheels the build then writes the image's
SBOM (sbom.py, from what the image holds) and its provenance (attest.py), signed where a key
is given.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..common.errors import HardenedError
from ..common.hashing import record_digest
from ..common.paths import patches_dir
from ..pipeline.build import TOOL_ROOT, Progress, build, tool_sources
from ..pipeline.lock import UpstreamPin, get_wheels, pin_for
from ..pipeline.manifest import build_manifest
from ..pipeline.series import load_series
from ..pipeline.stamp import hardened_version
from ..pipeline.wheelfile import record_entries
from ..runtime.identity import MANIFEST_NAME, RUNS_ON_PROBE
from .attest import CYCLONEDX, PROVENANCE, provenance, sign, statement, timestamp
from .engine import buildah_env, digests, pick_engine, run_in
from .sbom import image_sbom

DOCKERFILE = TOOL_ROOT / "Dockerfile"
TOOL_DOCKERFILE = TOOL_ROOT / "Dockerfile.tool"  # the slim tool image: the tool wheel alone


def wheel_manifest(wheel: Path) -> dict:
    """The hardening manifest a built wheel carries (what `info` reads once installed)."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(f".dist-info/{MANIFEST_NAME}")]
        if len(names) != 1:
            raise HardenedError(f"{wheel.name} is not a hardened sglang wheel (no {MANIFEST_NAME})")
        return json.loads(zf.read(names[0]))


def build_args(manifest: dict, base_image: str | None = None) -> dict[str, str]:
    """The Dockerfile's build args; BASE_IMAGE only when overriding upstream's image."""
    args = {
        "SGLANG_BASE": manifest["base"],
        "HARDENED_VERSION": manifest["version"],
        "HARDENING_IDS": " ".join(manifest["hardening_ids"]),
        "UPSTREAM_SHA256": manifest["upstream"]["sha256"],
        "TOOL_VERSION": manifest["tool"]["version"],
    }
    if base_image:
        args["BASE_IMAGE"] = base_image
    return args


def default_tag(version: str, tool_only: bool = False) -> str:
    """`sglang-hardened:0.5.23-hardened.1` (an image tag cannot hold the `+`); the tool image's
    `sglang-hardened-tool:0.5.23-hardened.1`, the same tag as the servers' it goes with."""
    return f"sglang-hardened{'-tool' if tool_only else ''}:{version.replace('+', '-')}"


# The OCI platform of each machine upstream ships wheels for (Python's name -> the engines').
PLATFORMS = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}


def build_command(engine: str, dockerfile: Path, context: Path, tag: str, args: dict[str, str],
                  labels: dict[str, str], platform: str) -> list[str]:
    """The engine's build command, for the base's ``platform`` (an arm64 base on an x86_64 host
    builds under emulation). buildah writes Docker format: OCI drops HEALTHCHECK. Not quiet: a
    pull of upstream's multi-gigabyte image and pip's install take minutes, which its lines show."""
    flags = [f"--build-arg={key}={value}" for key, value in sorted(args.items())]
    flags += [f"--label={key}={value}" for key, value in sorted(labels.items())]
    tool = ["docker", "build"] if engine == "docker" else ["buildah", "bud", "--format", "docker"]
    return [*tool, "--platform", platform, "-f", str(dockerfile), "-t", tag, *flags, str(context)]


def tool_wheel_is_current(wheel: Path) -> bool:
    """Does the wheel hold exactly this checkout's package files (same version, same code)?"""
    source = {f"sglang_hardened/{p.relative_to(TOOL_ROOT / 'sglang_hardened').as_posix()}": record_digest(p.read_bytes())
              for p in tool_sources()}
    packed = {name: digest for name, digest in record_entries(wheel).items() if name.startswith("sglang_hardened/")}
    return packed == source


def hardened_name(pin: UpstreamPin, version: str) -> str:
    """The file name the build gives the hardened wheel of ``pin``."""
    return pin.file.replace(f"sglang-{pin.base}-", f"sglang-{version}-", 1)


def ensure_wheels(base: str, out_dir: Path, progress: Progress, runs_on: str | None = None) -> tuple[Path, Path]:
    """The hardened wheel of `base` for ``runs_on`` (``cp312 x86_64``: the image's Python and
    machine; default the reference wheel's) and the tool wheel, in `out_dir`, built unless
    current ones are there.

    Current means: the hardened wheel's manifest is what the series would
    produce now, and the tool wheel holds this checkout's code.
    """
    patches = patches_dir()
    pins, series = get_wheels(patches, base), load_series(patches, base)
    pin = pin_for(pins, runs_on) if runs_on else pins[0]
    version = hardened_version(base, series.revision)
    found = out_dir / hardened_name(pin, version)
    tools = sorted(out_dir.glob(f"sglang_hardened-{__version__}-*.whl"))
    if (found.is_file() and len(tools) == 1
            and wheel_manifest(found) == build_manifest(pin, series, version)
            and tool_wheel_is_current(tools[0])):
        progress(f"{base}: using {found.name} and {tools[0].name}")
        return found, tools[0]
    results, tool = build([base], out_dir, patches=patches, progress=progress, choose=lambda wheels: [pin])
    return results[0].wheel, tool


def base_image_runs_on(engine: str, image: str) -> str:
    """The CPython tag and machine of the base image's ``python3`` (``cp312 x86_64``), which the
    image's hardened wheel must be built for: the official image runs 3.12, not the sandbox's 3.11."""
    found = run_in(engine, image, ["python3", "-c", RUNS_ON_PROBE]).strip()
    if len(found.split()) != 2:
        raise HardenedError(f"could not read the Python of the base image {image}: python3 printed {found[-200:]!r}")
    return found


def default_base_image(base: str, dockerfile: Path = DOCKERFILE) -> str:
    """The Dockerfile's own BASE_IMAGE for `base` (upstream's image of the release; the tool
    image's small Python)."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile.read_text(), re.M)
    if not match:
        raise HardenedError(f"{dockerfile} has no `ARG BASE_IMAGE=` default")
    return match.group(1).replace("${SGLANG_BASE}", base)


def _stage(wheels: tuple[Path, ...], context: Path) -> None:
    """Put the wheels in the context: hard links where possible, else copies."""
    for wheel in wheels:
        try:
            os.link(wheel, context / wheel.name)
        except OSError:
            shutil.copy2(wheel, context / wheel.name)


@dataclass(frozen=True)
class Built:
    """A built image and what the build wrote beside it."""

    tag: str
    engine: str
    args: dict[str, str]
    image_id: str  # sha256 of its config: the ID every engine shows, and the same after a push
    files: tuple[Path, ...]  # the SBOM, the provenance and, with a key, the signed attestations


def _git(*args: str) -> str | None:
    run = subprocess.run(["git", "-C", str(TOOL_ROOT), *args], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else None


def source_labels(base_digest: str | None, created: dt.datetime) -> dict[str, str]:
    """The OCI labels only the build knows (the Dockerfile sets those the wheel's manifest
    says): where the source is (the checkout's ``origin``), its revision (``-dirty`` with
    uncommitted changes to tracked files), when, and the base's digest. Each is left out where
    unknown: a label must not claim what was not seen."""
    revision = _git("rev-parse", "HEAD")
    if revision and _git("status", "--porcelain", "--untracked-files=no"):
        revision += "-dirty"
    found = {"source": _git("remote", "get-url", "origin"), "revision": revision,
             "created": timestamp(created), "base.digest": base_digest}
    return {f"org.opencontainers.image.{key}": value for key, value in found.items() if value}


def build_created() -> dt.datetime:
    """SOURCE_DATE_EPOCH where set (a reproducible build's date), else now."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC) if epoch else dt.datetime.now(dt.UTC)


def attestation_files(out_dir: Path, tag: str) -> tuple[Path, Path, Path]:
    """Where the build of ``tag`` writes its SBOM, its provenance and, signed, both."""
    stem = re.sub(r"[^\w.-]+", "_", tag)
    return out_dir / f"{stem}.cdx.json", out_dir / f"{stem}.provenance.json", out_dir / f"{stem}.intoto.jsonl"


def build_image(base: str, out_dir: Path, *, engine: str | None = None,
                base_image: str | None = None, tag: str | None = None, signing_key: Path | None = None,
                tool_only: bool = False, extra_args: dict[str, str] | None = None,
                progress: Progress = lambda msg: None) -> Built:
    """Build the image for `base` (``tool_only``: the slim tool image that goes with it), then
    its SBOM and provenance beside the wheels in `out_dir` (signed with ``signing_key`` where
    one is given). ``extra_args``: build args of the caller's (a proxy, PIP_NO_INDEX), after
    the manifest's."""
    dockerfile = TOOL_DOCKERFILE if tool_only else DOCKERFILE
    if not dockerfile.is_file():
        raise HardenedError(f"no {dockerfile.name} at {dockerfile}: build images from a checkout")
    started = dt.datetime.now(dt.UTC)
    engine = engine or pick_engine()
    base_image = base_image or default_base_image(base, dockerfile)
    runs_on = base_image_runs_on(engine, base_image)
    base_digest = digests(engine, base_image)[1]
    progress(f"{base}: the base image runs {runs_on}; its digest {base_digest or 'is unknown (never pulled)'}")
    # the tool image installs the tool wheel alone, but is labelled from the hardened wheel's
    # manifest like the servers' image: the same versions, so the two are told apart by name only
    wheel, tool = ensure_wheels(base, out_dir, progress, None if tool_only else runs_on)
    installed = {"sglang-hardened": tool} if tool_only else {"sglang": wheel, "sglang-hardened": tool}
    manifest = wheel_manifest(wheel)
    args = {**build_args(manifest, base_image), **(extra_args or {})}
    tag = tag or default_tag(manifest["version"], tool_only)
    created = build_created()
    labels = source_labels(base_digest, created)
    platform = PLATFORMS[runs_on.split()[1]]
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".image-") as context:
        _stage(tuple(installed.values()), Path(context))
        progress(f"{base}: building {tag} for {platform} with {engine}")
        returncode, tail = _streamed(build_command(engine, dockerfile, Path(context), tag, args, labels, platform),
                                     progress)
    if returncode != 0:
        raise HardenedError(f"{engine} build of {tag} failed (exit {returncode}):\n" + "\n".join(tail))
    image_id = digests(engine, tag)[0]
    progress(f"{base}: built {tag} ({image_id}); reading what it holds for its SBOM")
    inventory = json.loads(run_in(engine, tag, ["python3", "-m", "sglang_hardened.image.inventory"]))
    sbom = image_sbom(inventory, tag=tag, image_id=image_id, created=timestamp(created), base_image=base_image,
                      base_digest=base_digest, wheels=installed)
    predicate = provenance(engine=engine, platform=platform, args=args, base_image=base_image,
                           base_digest=base_digest, source=labels.get("org.opencontainers.image.source"),
                           revision=labels.get("org.opencontainers.image.revision"),
                           inputs=[*installed.values(), dockerfile],
                           started=started, finished=dt.datetime.now(dt.UTC))
    sbom_file, provenance_file, signed = attestation_files(out_dir, tag)
    files = {sbom_file: sbom, provenance_file: statement(tag, image_id, PROVENANCE, predicate)}
    for path, document in files.items():
        path.write_text(json.dumps(document, indent=1) + "\n")
    if signing_key is not None:
        signed.write_text("".join(json.dumps(sign(statement(tag, image_id, kind, document), signing_key)) + "\n"
                                  for kind, document in ((PROVENANCE, predicate), (CYCLONEDX, sbom))))
        files[signed] = None
    return Built(tag, engine, args, image_id, tuple(files))


FAILURE_LINES = 40  # of the engine's output, in the error a failed build raises


def _streamed(command: list[str], progress: Progress) -> tuple[int, deque[str]]:
    """Run the engine, each line of its output to ``progress`` as it comes; its exit code and
    its last FAILURE_LINES lines."""
    tail: deque[str] = deque(maxlen=FAILURE_LINES)
    with subprocess.Popen(command, env=buildah_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as engine:
        for line in engine.stdout:
            tail.append(line.rstrip())
            progress(f"  {tail[-1]}")
    return engine.returncode, tail
