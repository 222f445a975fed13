"""Weight transports: how new weights reach one vLLM replica.

* :mod:`updater.transports.base` — the :class:`~updater.transports.base.Transport` contract
  (preflight never mutates; transfer does) and :class:`~updater.transports.base.WeightsTarget`.
* :mod:`updater.transports.preflight` — the target check every transport runs in preflight.
* :mod:`updater.transports.registry` — transports by name (``UpdaterSettings.transport``).
* :mod:`updater.transports.reload` — ``reload``: ``/collective_rpc reload_weights`` from a
  safetensors directory the server can read (CPU and GPU).
* :mod:`updater.transports.nccl` — ``nccl``: a broadcast over NCCL through vLLM's
  weight-transfer engine (GPU), in process or from a checkpoint (a package; see its docstring).

The package imports nothing until a name is asked of it, so the settings validate a transport's
name (:mod:`updater.transports.registry`) without loading any transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from updater.transports.base import Transport, WeightsTarget
    from updater.transports.reload import ReloadTransport

#: Each exported name -> the module that defines it (imported when the name is first asked for).
_HOMES: dict[str, str] = {
    "ReloadTransport": "updater.transports.reload",
    "Transport": "updater.transports.base",
    "WeightsTarget": "updater.transports.base",
}

__all__ = ["ReloadTransport", "Transport", "WeightsTarget"]


def __getattr__(name: str) -> Any:
    """The exported ``name`` from its module, imported now (PEP 562)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
