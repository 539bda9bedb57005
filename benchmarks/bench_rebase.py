"""Rebase of one series onto one newer release (warm cache), against its floor.

    python benchmarks/bench_rebase.py --from 0.5.19 --to 0.5.21 --repeat 3

The floor is reading the files the series touches out of both wheels, which
any rebase must do; the rest is applying and three-way merging. Medians and
their ratio, measured in the same run. Nothing is written.
"""

from __future__ import annotations

import argparse
import time
import zipfile

from floor_report import print_against_floor  # benchmarks/ is on sys.path when run as a script

from sglang_hardened.common.paths import patches_dir
from sglang_hardened.pipeline import unidiff
from sglang_hardened.pipeline.fetch import fetch_wheel
from sglang_hardened.pipeline.lock import load_lock
from sglang_hardened.pipeline.rebase import rebase
from sglang_hardened.pipeline.series import load_series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", default="0.5.19")
    parser.add_argument("--to", dest="target", default="0.5.21")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    patches = patches_dir()
    pins = load_lock(patches)
    names = {fp.target for p in load_series(patches, args.source).patches for fp in unidiff.parse(p.diff)}
    wheels = [fetch_wheel(pins[args.source]), fetch_wheel(pins[args.target])]
    floors, rebases, verdicts = [], [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for name in names:
                    zf.read(name)
        floors.append(time.perf_counter() - start)
        start = time.perf_counter()
        result = rebase(patches, args.source, args.target)
        rebases.append(time.perf_counter() - start)
        verdicts = [v.verdict for v in result.verdicts]
    print_against_floor("read touched files (floor)", floors, f"rebase {args.source} -> {args.target}",
                        rebases, "ratio rebase/floor", ", ".join(verdicts), digits=3)


if __name__ == "__main__":
    main()
