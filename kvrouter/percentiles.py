"""Percentiles, one definition for every report, benchmark and table: linear interpolation between the
two nearest ranks (numpy's default, and the peerbench harnesses'), so figures from different commands
compare."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1) of ``values``; NaN when there are none."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summary_us(values: Sequence[float]) -> dict[str, float]:
    """Count, p50 / p99 / mean in microseconds of timings given in seconds."""
    return {
        "n": len(values),
        "p50_us": round(quantile(values, 0.5) * 1e6, 2),
        "p99_us": round(quantile(values, 0.99) * 1e6, 2),
        "mean_us": round(statistics.fmean(values) * 1e6, 2) if values else float("nan"),
    }
