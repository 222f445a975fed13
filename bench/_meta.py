"""Benchmark result metadata (kept in :mod:`rolloutpool.results`)."""

from rolloutpool.results import RESULTS, meta, write

__all__ = ["RESULTS", "meta", "write"]
