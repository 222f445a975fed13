"""The statistics the benchmarks and scenarios report, defined once."""

from __future__ import annotations

import statistics


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, nearest rank; 0.0 for no values."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else 0.0


def med(xs: list[float], digits: int = 4) -> float | None:
    """The median of ``xs`` rounded to ``digits``; None for no values."""
    return round(statistics.median(xs), digits) if xs else None
