"""Transports by name: ``UpdaterSettings.transport`` names one, :func:`create` builds it.

Shaped like vLLM's ``vllm/distributed/weight_transfer/factory.py``: a name maps to a module path
and a class name, and the module is imported only when the class is first asked for
(:meth:`TransportRegistry.get`), so a transport's own dependencies load only when it is used, and
the settings validate a name (:meth:`TransportRegistry.require`) without importing anything.
Registering a name twice raises; asking for an unknown name raises with the names there are.
The built-ins are registered at the bottom; another transport registers the same way before the
settings are built::

    from updater.transports import registry
    registry.register("mine", "my_package.transport", "MyTransport")

Not thread-safe: register at import time, from one thread.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from updater.transports.base import Transport

if TYPE_CHECKING:
    from updater.settings import UpdaterSettings

__all__ = ["TransportRegistry", "create", "get", "names", "register", "require"]


class TransportRegistry:
    """Name → ``(module path, class name)`` of a :class:`~updater.transports.base.Transport`."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Make ``module_path.class_name`` the transport called ``name`` (nothing is imported
        now). Raises ``ValueError`` if ``name`` is taken."""
        if name in self._entries:
            module, cls = self._entries[name]
            raise ValueError(f"transport {name!r} is already registered ({module}.{cls})")
        self._entries[name] = (module_path, class_name)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def require(self, name: str) -> str:
        """``name`` if it is registered (nothing is imported); else ``ValueError`` listing the
        registered names."""
        if name not in self._entries:
            raise ValueError(
                f"unknown transport {name!r}; registered: {', '.join(self.names()) or 'none'}"
            )
        return name

    def get(self, name: str) -> type[Transport]:
        """The class registered as ``name``, imported now. ``ValueError`` for an unknown name;
        ``ImportError`` / ``AttributeError`` if the registration points nowhere; ``TypeError``
        if it points at something that is not a Transport."""
        module_path, class_name = self._entries[self.require(name)]
        cls = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise TypeError(f"transport {name!r}: {module_path}.{class_name} is not a Transport")
        return cls

    def create(self, settings: UpdaterSettings) -> Transport:
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
register("nccl", "updater.transports.nccl", "NcclTransport")
register("nccl_direct", "updater.transports.nccl.direct", "NcclDirectTransport")
