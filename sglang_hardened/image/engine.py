"""What the image code asks of an engine (Docker or buildah) besides the build: which one to
use, a command run inside an image with no network, and an image's digests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from ..common.errors import HardenedError


def pick_engine() -> str:
    """Docker where its daemon answers, else buildah (daemonless: CI, inside containers)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if probe.returncode == 0:
            return "docker"
    if shutil.which("buildah"):
        return "buildah"
    raise HardenedError("no image engine: start a Docker daemon or install buildah")


def buildah_env() -> dict[str, str]:
    """chroot isolation needs no OCI runtime and works inside containers; an explicit setting wins."""
    return {**os.environ, "BUILDAH_ISOLATION": os.environ.get("BUILDAH_ISOLATION", "chroot")}


def run_in(engine: str, image: str, argv: list[str]) -> str:
    """``argv``'s stdout, run in a container of ``image`` with no network (buildah's chroot
    isolation has none to give); what it printed on failure in the error."""
    if engine == "docker":
        run = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", argv[0], image, *argv[1:]],
                             capture_output=True, text=True)
    else:
        opened = subprocess.run(["buildah", "from", "--quiet", image], env=buildah_env(), capture_output=True, text=True)
        if opened.returncode != 0:
            raise HardenedError(f"buildah could not open the image {image}: {opened.stderr.strip()[-500:]}")
        ctr = opened.stdout.strip()
        try:
            run = subprocess.run(["buildah", "run", ctr, "--", *argv], env=buildah_env(), capture_output=True, text=True)
        finally:
            subprocess.run(["buildah", "rm", ctr], env=buildah_env(), capture_output=True)
    if run.returncode != 0:
        raise HardenedError(f"`{' '.join(argv)[:80]}` failed in {image} (exit {run.returncode}): "
                            f"{(run.stderr or run.stdout).strip()[-500:]}")
    return run.stdout


def digests(engine: str, image: str) -> tuple[str, str | None]:
    """``image``'s ID (its config's digest, ``sha256:...``: what its layers and settings hash to,
    on every engine) and its manifest's digest where the engine knows it (buildah always; Docker
    only for an image pulled from or pushed to a registry)."""
    if engine == "docker":
        run = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True)
        if run.returncode != 0:
            raise HardenedError(f"docker cannot inspect {image}: {run.stderr.strip()[-300:]}")
        found = json.loads(run.stdout)[0]
        repo = [d.split("@", 1)[1] for d in found.get("RepoDigests") or []]
        return found["Id"], repo[0] if repo else None
    run = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}} {{.FromImageDigest}}",
                          image], env=buildah_env(), capture_output=True, text=True)
    if run.returncode != 0:
        raise HardenedError(f"buildah cannot inspect {image}: {run.stderr.strip()[-300:]}")
    config, manifest = run.stdout.split()
    return f"sha256:{config}", manifest
