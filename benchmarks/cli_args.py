"""Argument types the benchmarks' command lines share."""

from __future__ import annotations


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (empty parts skipped): argparse's ``type=`` for a list
    of settings, so a bad one is refused with argparse's error naming the option."""
    return [int(x) for x in text.split(",") if x.strip()]
