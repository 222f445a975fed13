"""Benchmark result metadata (kept in :mod:`rolloutpool.results`), and where results go."""

from pool.paths import default_results_dir
from rolloutpool.results import meta, write

#: The results directory, read once when a benchmark starts: ``$ROLLOUTPOOL_RESULTS``, else the
#: checkout's ``bench/results`` (:func:`pool.paths.default_results_dir`).
RESULTS = default_results_dir()

__all__ = ["RESULTS", "meta", "write"]
