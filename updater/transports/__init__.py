"""Weight transports: how new weights reach one vLLM replica.

* :mod:`updater.transports.base` — the :class:`~updater.transports.base.Transport` contract
  (preflight never mutates; transfer does) and :class:`~updater.transports.base.WeightsTarget`.
* :mod:`updater.transports.preflight` — the target check every transport runs in preflight.
* :mod:`updater.transports.registry` — transports by name (``UpdaterSettings.transport``).
* :mod:`updater.transports.reload` — ``reload``: ``/collective_rpc reload_weights`` from a
  safetensors directory the server can read (CPU and GPU).
* :mod:`updater.transports.nccl` — ``nccl``: a broadcast over NCCL through vLLM's
  weight-transfer engine (GPU), in process or from a checkpoint (a package; see its docstring).
"""

from updater.transports.base import Transport, WeightsTarget
from updater.transports.reload import ReloadTransport

__all__ = ["ReloadTransport", "Transport", "WeightsTarget"]
