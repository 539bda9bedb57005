"""Image build time (buildah, warm substitute base) against the floor: a bare pip install of the same wheels.

    python benchmarks/bench_image.py --base 0.5.23 --repeat 3

Needs root, buildah and the substitute base (tests/image/substitute-base
makes it, cached). The wheels are built once, before timing. The floor is
the least any image build must do: `COPY` the two wheels and `pip install`
them on the same base. The hardened build adds the wheel checks, the build
args from the manifest and the Dockerfile's own steps. Both are measured in
the same run, interleaved, and reported as medians and their ratio (goal:
the hardened build within 1.25x of the floor).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from floor_report import print_against_floor  # benchmarks/ is on sys.path when run as a script

from sglang_hardened.image.build import build_image
from sglang_hardened.pipeline.build import build

REPO = Path(__file__).resolve().parent.parent
TAG = "localhost/sglang-hardened-bench:latest"
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}


def buildah(*args: str) -> None:
    subprocess.run(["buildah", *args], env=ENV, check=True, stdout=subprocess.DEVNULL)


def floor(base_image: str, wheels: Path, workdir: Path) -> float:
    containerfile = workdir / "Containerfile.floor"
    containerfile.write_text(f"FROM {base_image}\nCOPY *.whl /tmp/wheels/\n"
                             "RUN PIP_ROOT_USER_ACTION=ignore python3 -m pip install --no-index --no-deps /tmp/wheels/*.whl\n")
    start = time.perf_counter()
    buildah("bud", "--format", "docker", "--quiet", "-f", str(containerfile), "-t", TAG, str(wheels))
    elapsed = time.perf_counter() - start
    buildah("rmi", TAG)
    return elapsed


def hardened(base: str, base_image: str, wheels: Path) -> float:
    start = time.perf_counter()
    build_image(base, wheels, engine="buildah", base_image=base_image, tag=TAG)
    elapsed = time.perf_counter() - start
    buildah("rmi", TAG)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.5.23")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base_image = subprocess.run([str(REPO / "tests/image/substitute-base")], env=ENV, check=True,
                                capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "dist"
        build([args.base], wheels)
        floors, builds = [], []
        for _ in range(args.repeat):
            floors.append(floor(base_image, wheels, Path(tmp)))
            builds.append(hardened(args.base, base_image, wheels))
    print_against_floor("COPY + pip install (floor)", floors, f"hardened image {args.base}", builds,
                        "ratio image/floor", "goal <= 1.25")


if __name__ == "__main__":
    main()
