"""Order statistics the benchmarks share."""

from __future__ import annotations


def quantile(values: list[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (for n <= 100 the 0.99 quantile is
    the largest): no interpolation, so it is a value a run gave."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
