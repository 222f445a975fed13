"""Transports by name: ``UpdaterSettings.transport`` names one, :func:`create` builds it.

A :class:`~updater.registry.Registry` of :class:`~updater.transports.base.Transport` classes
(lazy import, a duplicate name raises, an unknown one lists the registered names); the built-ins
are registered at the bottom. Another transport registers the same way before the settings are
built::

    from updater.transports import registry
    registry.register("mine", "my_package.transport", "MyTransport")

Not thread-safe: register at import time, from one thread.
"""

from __future__ import annotations

from updater.registry import Registry
from updater.transports.base import Transport, TransportSettings

__all__ = ["TransportRegistry", "create", "get", "names", "register", "require"]


class TransportRegistry(Registry[Transport]):
    """Name → ``(module path, class name)`` of a :class:`~updater.transports.base.Transport`."""

    def __init__(self) -> None:
        super().__init__("transport", Transport)

    def create(self, settings: TransportSettings) -> Transport:
        """The transport ``settings.transport`` names, built from ``settings``
        (:meth:`Transport.from_settings`)."""
        return self.get(settings.transport).from_settings(settings)


_REGISTRY = TransportRegistry()

register = _REGISTRY.register
names = _REGISTRY.names
require = _REGISTRY.require
get = _REGISTRY.get
create = _REGISTRY.create

# ------------------------------------------------------------------------------ built-ins

register("reload", "updater.transports.reload", "ReloadTransport")
register("nccl", "updater.transports.nccl.transport", "NcclTransport")
register("nccl_direct", "updater.transports.nccl.direct", "NcclDirectTransport")
register("ipc_direct", "updater.transports.ipc", "IpcDirectTransport")
