"""Build time of one base (warm cache) against the floor: plain `unzip` + `zip` of the same wheel.

    python benchmarks/bench_build.py --base 0.5.23 --repeat 3

Both are measured in the same run, interleaved, and reported as medians and
their ratio (goal: the build within 2x of the floor).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from floor_report import print_against_floor  # benchmarks/ is on sys.path when run as a script

from sglang_hardened.common.paths import patches_dir
from sglang_hardened.pipeline.build import build_one
from sglang_hardened.pipeline.fetch import fetch_wheel
from sglang_hardened.pipeline.lock import get_pin
from sglang_hardened.pipeline.series import load_series


def floor(wheel: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run(["unzip", "-q", str(wheel), "-d", f"{tmp}/tree"], check=True)
        subprocess.run(["zip", "-q", "-r", "-X", f"{tmp}/out.whl", "."], cwd=f"{tmp}/tree", check=True)
        return time.perf_counter() - start


def hardened(base: str) -> float:
    patches = patches_dir()
    pin, series = get_pin(patches, base), load_series(patches, base)
    upstream = fetch_wheel(pin)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        build_one(pin, series, upstream, Path(tmp), lambda msg: None)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="0.5.23")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    wheel = fetch_wheel(get_pin(patches_dir(), args.base))
    floors, builds = [], []
    for _ in range(args.repeat):
        floors.append(floor(wheel))
        builds.append(hardened(args.base))
    print_against_floor("unzip + zip (floor)", floors, f"build {args.base}", builds,
                        "ratio build/floor", "goal <= 2.00")


if __name__ == "__main__":
    main()
