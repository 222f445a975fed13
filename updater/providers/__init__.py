"""Replica providers: who runs a pool's replica processes (the port and its adapters).

Reading order: :mod:`~updater.providers.base` (the port and its contract),
:mod:`~updater.providers.registry` (providers by name), then one adapter:
:mod:`~updater.providers.local`, :mod:`~updater.providers.external`,
:mod:`~updater.providers.ray` (with :mod:`~updater.providers.ray_actor`, the code that runs on
the cluster, and :mod:`~updater.providers.leash`), :mod:`~updater.providers.kubernetes`.
:mod:`~updater.providers.config` holds the Ray and Kubernetes settings. The adapters are
imported only when named (``ray`` and the Kubernetes client are optional extras).
"""
