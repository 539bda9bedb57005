"""Order statistics the benchmarks share."""

from __future__ import annotations

import math
import statistics


def quantile(values: list[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values (for n <= 100 the 0.99 quantile is
    the largest): no interpolation, so it is a value a run gave."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Student's t, two-sided 95 %, by degrees of freedom 1-30 (any table: e.g. NIST/SEMATECH 1.3.6.7.2)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def mean_interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95 % t interval (runs independent, their mean about
    normal); with one value, an infinite half-width: one run says nothing of its spread."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("inf")
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    df = n - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.960 + 2.4 / df  # past 30: within 0.002 of the table
    return mean, t * sd / n ** 0.5


def median_interval(values: list[float]) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the median and the narrowest order-statistic interval
    [x(k), x(n+1-k)] that holds it with at least 95 % whatever the distribution. Under six
    values none does: then the range, with the coverage it has (93.75 % for five). (A
    percentile bootstrap of the median gives that same range at five and claims 95 %.)"""
    xs, n = sorted(values), len(values)

    def covers(k: int) -> float:  # 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = max((k for k in range(1, n // 2 + 1) if covers(k) >= 0.95), default=1)
    return statistics.median(xs), xs[k - 1], xs[n - k], covers(k)
