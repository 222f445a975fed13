"""Weight transports: how new weights reach one vLLM replica.

* :mod:`updater.transports.base` — the :class:`~updater.transports.base.Transport` contract.
* :mod:`updater.transports.reload` — ``reload``: ``/collective_rpc reload_weights`` from a
  safetensors directory the server can read (CPU and GPU).
"""

from updater.transports.base import Transport, WeightsTarget
from updater.transports.reload import ReloadTransport

__all__ = ["ReloadTransport", "Transport", "WeightsTarget"]
