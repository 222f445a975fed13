"""Plug-ins by name, imported on first use: the shape of the transport and provider registries.

Shaped like vLLM's ``vllm/distributed/weight_transfer/factory.py``: a name maps to a module path
and a class name, and the module is imported only when the class is first asked for
(:meth:`Registry.get`), so a plug-in's own dependencies (torch, ray, the Kubernetes client) load
only when it is used, and settings validate a name (:meth:`Registry.require`) without importing
anything. Registering a name twice raises; asking for an unknown name raises with the names
there are. :mod:`updater.transports.registry` and :mod:`updater.providers.registry` each hold
one, with their built-ins registered at the bottom.

Not thread-safe: register at import time, from one thread.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar, cast

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → ``(module path, class name)`` of a subclass of ``base`` (``T``, usually an ABC);
    ``kind`` names what is registered in messages ("transport", "replica provider")."""

    def __init__(self, kind: str, base: type[object]) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Make ``module_path.class_name`` the plug-in called ``name`` (nothing is imported
        now). Raises ``ValueError`` if ``name`` is taken."""
        if name in self._entries:
            module, cls = self._entries[name]
            raise ValueError(f"{self.kind} {name!r} is already registered ({module}.{cls})")
        self._entries[name] = (module_path, class_name)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def require(self, name: str) -> str:
        """``name`` if it is registered (nothing is imported); else ``ValueError`` listing the
        registered names."""
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}"
            )
        return name

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``, imported now. ``ValueError`` for an unknown name;
        ``ImportError`` / ``AttributeError`` if the registration points nowhere; ``TypeError``
        if it points at something that is not a subclass of ``base``."""
        module_path, class_name = self._entries[self.require(name)]
        cls = getattr(importlib.import_module(module_path), class_name)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(
                f"{self.kind} {name!r}: {module_path}.{class_name} is not a {self.base.__name__}"
            )
        return cast("type[T]", cls)
