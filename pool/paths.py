"""Where RolloutPool keeps files on this machine: its cache and the benchmark results.

The cache (``<cache>`` in the configuration reference) holds what is built or run locally (the tiny
models, the embedded pool's Redis data, checkpoints and logs, local replicas' work directories); the
results directory holds the JSON (and figures) ``rolloutpool demo`` and the benchmarks write. Each
is chosen in this order:

1. its environment variable, when set: ``$ROLLOUTPOOL_CACHE``, ``$ROLLOUTPOOL_RESULTS``;
2. in a development checkout (the packages imported from the source tree, as an editable
   install or from the checkout's root: :func:`checkout_root`), the checkout's own git-ignored
   ``.cache`` and its committed ``bench/results``;
3. otherwise (installed from the wheel), the user's directories of the XDG base directory
   spec: ``$XDG_CACHE_HOME/rolloutpool`` (``~/.cache/rolloutpool`` when unset) and
   ``$XDG_DATA_HOME/rolloutpool/results`` (``~/.local/share/rolloutpool/results``).

Every function reads the environment on each call and creates nothing: callers make the
directories they write into.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["checkout_root", "default_cache_root", "default_results_dir"]

#: The directory above the ``pool`` package: a checkout's root, or site-packages.
_ABOVE = Path(__file__).resolve().parent.parent


def checkout_root() -> Path | None:
    """The checkout's root when the packages are imported from a source tree (its
    ``pyproject.toml`` names the ``rolloutpool`` project), else ``None`` (installed)."""
    pyproject = _ABOVE / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return _ABOVE if 'name = "rolloutpool"' in text else None


def _xdg(variable: str, fallback: str) -> Path:
    """``$variable`` if set to an absolute path (the spec ignores relative ones), else
    ``~/<fallback>``."""
    value = os.environ.get(variable, "")
    return Path(value) if os.path.isabs(value) else Path.home() / fallback


def default_cache_root() -> Path:
    """The cache directory (absolute): ``$ROLLOUTPOOL_CACHE``, else the checkout's ``.cache``,
    else ``$XDG_CACHE_HOME/rolloutpool`` (see the module docstring)."""
    env = os.environ.get("ROLLOUTPOOL_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    root = checkout_root()
    if root is not None:
        return root / ".cache"
    return _xdg("XDG_CACHE_HOME", ".cache") / "rolloutpool"


def default_results_dir() -> Path:
    """The results directory (absolute): ``$ROLLOUTPOOL_RESULTS``, else the checkout's
    ``bench/results``, else ``$XDG_DATA_HOME/rolloutpool/results`` (see the module docstring)."""
    env = os.environ.get("ROLLOUTPOOL_RESULTS")
    if env:
        return Path(env).expanduser().resolve()
    root = checkout_root()
    if root is not None:
        return root / "bench" / "results"
    return _xdg("XDG_DATA_HOME", ".local/share") / "rolloutpool" / "results"
