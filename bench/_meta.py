"""Benchmark result metadata (kept in :mod:`rolloutpool.results`)."""

from rolloutpool.results import meta, write

__all__ = ["meta", "write"]
