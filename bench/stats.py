"""Small statistics of the benchmarks: nearest-rank percentiles, medians, seconds as ms."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


# ---- statistics -----------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) by nearest rank; None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)
