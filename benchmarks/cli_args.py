"""Argument types the benchmarks' command lines share."""

from __future__ import annotations

import argparse


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (empty parts skipped): argparse's ``type=`` for a list
    of settings, so a bad one is refused with argparse's error naming the option."""
    return [int(x) for x in text.split(",") if x.strip()]


def serving_options(parser: argparse.ArgumentParser) -> None:
    """The base and the A/B's workload, which the other serving benchmarks run too: the load
    generator's `random-ids` prompts (inputs 63-900, outputs 17-256 tokens by default), seeded,
    after a warm-up."""
    parser.add_argument("--base", default="0.5.23")
    parser.add_argument("--warmup", type=int, default=8, help="prompts run and discarded on each fresh cluster")
    parser.add_argument("--input-len", type=int, default=900)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.07)
    parser.add_argument("--seed", type=int, default=1)
