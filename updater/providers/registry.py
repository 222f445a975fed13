"""Replica providers by name: ``UpdaterSettings.provider`` names one, :func:`create` builds it.

A :class:`~updater.registry.Registry` of :class:`~updater.providers.base.ReplicaProvider`
classes: a provider's module (and so ``ray`` or the Kubernetes client) is imported only when it
is used. Built-ins are registered at the bottom; another provider registers the same way before
the settings are built::

    from updater.providers import registry
    registry.register("slurm", "my_package.slurm", "SlurmProvider")

Not thread-safe: register at import time, from one thread.
"""

from __future__ import annotations

from updater.providers.base import ProviderSettings, ReplicaProvider
from updater.registry import Registry

__all__ = ["ProviderRegistry", "create", "get", "names", "register", "require"]


class ProviderRegistry(Registry[ReplicaProvider]):
    """Name → ``(module path, class name)`` of a :class:`ReplicaProvider`."""

    def __init__(self) -> None:
        super().__init__("replica provider", ReplicaProvider)

    def create(self, settings: ProviderSettings) -> ReplicaProvider:
        """The provider ``settings.provider`` names, built from ``settings``."""
        return self.get(settings.provider).from_settings(settings)


_REGISTRY = ProviderRegistry()

register = _REGISTRY.register
names = _REGISTRY.names
require = _REGISTRY.require
get = _REGISTRY.get
create = _REGISTRY.create

# ------------------------------------------------------------------------------ built-ins

register("local", "updater.providers.local", "LocalProvider")
register("external", "updater.providers.external", "ExternalProvider")
register("ray", "updater.providers.ray", "RayProvider")
register("kubernetes", "updater.providers.kubernetes", "KubernetesProvider")
