"""The embedded pool: a ``redis-server`` (local, or yours by URL), N vLLM replicas (CPU by
default), the updater and the router, all in (or started by) this process. Used by
``rolloutpool up``, ``demo`` and the Ray job of ``deploy/ray``.

:class:`PoolConfig` is what ``rolloutpool up --config pool.yaml`` reads; every field has a
default, so an empty file (or none) gives the embedded default: Redis on a free port with AOF in
``<workdir>/redis``, 2 replicas of the tiny model pinned to cores 0 and 1, the router on 8000
and the updater on 8300, both on 127.0.0.1. With ``provider: ray`` the replicas are Ray actors
on the cluster at ``ray.address`` (or the Ray job this runs in), placed by ``ray.placement``;
each node's ``ROLLOUTPOOL_CPU_BIND`` (if set) picks the cores of a CPU replica placed there.
``replica`` holds further :class:`~pool.launcher.ReplicaSpec` fields for every replica, e.g.
GPU replicas sharing one GPU::

    replica: {flavor: gpu, cuda_visible_devices: "0", enable_scale_out: false,
              extra_args: [--gpu-memory-utilization, "0.2"]}
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field, field_validator

from pool.launcher import ReplicaSpec, default_cache_root
from pool.settings import StoreSettings
from pool.web import start_server
from router.app import create_app as create_router
from router.settings import RouterSettings
from testkit.models import ensure_model
from testkit.redis_server import RedisServer
from updater.app import create_app as create_updater_app
from updater.providers.config import RayConfig
from updater.settings import ReplicaConfig, UpdaterSettings

Progress = Callable[[str], None]

#: ReplicaSpec fields the pool sets per replica (not overridable through ``PoolConfig.replica``).
_PER_REPLICA = frozenset({"model", "name", "port", "work_dir"})


class PoolConfig(BaseModel):
    """``rolloutpool up`` configuration (YAML). ``redis_url`` None and no ``redis.sentinels`` =
    embedded redis-server; ``redis`` holds further :class:`~pool.settings.StoreSettings` fields,
    e.g. ``{sentinels: [h1:26379, h2:26379, h3:26379], sentinel_service: rolloutpool,
    wait_replicas: 1}`` for a Redis that fails over (README "Redis that fails over")."""

    workdir: Path = Field(default_factory=lambda: default_cache_root() / "pool")
    fresh: bool = False  # wipe the embedded Redis data and checkpoints of earlier runs first
    redis_url: str | None = None
    namespace: str = "rp"
    model: Path | None = None  # None: the tiny model built locally (seed 1)
    model_init_std: float = 0.2
    replicas: int = Field(default=2, ge=1, le=16)
    #: Who runs the replicas: ``local`` (processes of this machine) or ``ray`` (Ray actors).
    provider: str = "local"
    ray: RayConfig = Field(default_factory=RayConfig)
    host: str = "127.0.0.1"  # where the router and the updater listen
    router_port: int = 8000
    updater_port: int = 8300
    admin_token: str | None = None  # None: a random one, printed at start
    api_keys: list[str] = Field(default_factory=list)
    enable_scale_out: bool = True
    router: dict[str, Any] = Field(default_factory=dict)  # extra RouterSettings fields
    updater: dict[str, Any] = Field(default_factory=dict)  # extra UpdaterSettings fields
    redis: dict[str, Any] = Field(default_factory=dict)  # extra StoreSettings fields
    #: Extra :class:`~pool.launcher.ReplicaSpec` fields for every replica (they win over the
    #: defaults above: ``cpu_bind`` per replica, ``enable_scale_out``); not the ones the pool
    #: sets per replica (``model``, ``name``, ``port``, ``work_dir``).
    replica: dict[str, Any] = Field(default_factory=dict)

    @field_validator("replica")
    @classmethod
    def _replica_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = set(v) & _PER_REPLICA
        if owned:
            raise ValueError(f"replica: {sorted(owned)} are set by the pool per replica")
        # unknown fields and bad values are refused now (ReplicaSpec forbids extras), not when
        # the pool starts
        ReplicaSpec(model=Path("/"), **v)
        return v

    @property
    def embedded_redis(self) -> bool:
        """Whether the pool starts its own redis-server (no URL, no sentinels, no cluster)."""
        return (
            self.redis_url is None
            and not self.redis.get("sentinels")
            and not self.redis.get("cluster")
        )

    def store_settings(self, embedded_url: str | None = None) -> StoreSettings:
        """The store settings of the pool (``embedded_url``: the embedded server's URL)."""
        extra = dict(self.redis)
        url = self.redis_url or embedded_url
        if url is not None:
            extra["url"] = url
        return StoreSettings(namespace=self.namespace, **extra)

    def replica_configs(self, model: Path) -> list[ReplicaConfig]:
        """The updater's replicas of model ``model``: ``replica-<i>``, CPU ones pinned to core
        ``i % 2``, with the ``replica`` fields on top."""
        return [
            ReplicaConfig(
                id=f"replica-{i}",
                model=model,
                launch=ReplicaSpec(
                    **{
                        "served_model_name": "rolloutpool",
                        "cpu_bind": str(i % 2),
                        "enable_scale_out": self.enable_scale_out,
                        **self.replica,
                        "model": model,
                        "name": f"replica-{i}",
                        # a Ray actor makes its own work dir on the node it lands on
                        "work_dir": self.workdir / f"replica-{i}"
                        if self.provider == "local"
                        else None,
                    }
                ),
            )
            for i in range(self.replicas)
        ]

    @field_validator("provider")
    @classmethod
    def _launching_provider(cls, name: str) -> str:
        if name not in ("local", "ray"):
            raise ValueError(
                f"rolloutpool up starts its replicas (provider local or ray); for {name!r} "
                "replicas run the updater with its own config (python -m updater --config)"
            )
        return name


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class EmbeddedPool:
    """Start with ``await pool.start()``; stop with ``await pool.stop()`` (idempotent)."""

    def __init__(self, config: PoolConfig, progress: Progress = _say) -> None:
        self.config = config
        self.say = progress
        self.admin_token = config.admin_token or secrets.token_urlsafe(18)
        self.redis: RedisServer | None = None
        self._runners: list[web.AppRunner] = []
        self.router_url = ""
        self.updater_url = ""
        self.model: Path | None = None

    async def start(self) -> EmbeddedPool:
        c = self.config
        if c.fresh:
            for sub in ("redis", "ckpts"):
                await asyncio.to_thread(shutil.rmtree, c.workdir / sub, True)
        c.workdir.mkdir(parents=True, exist_ok=True)
        embedded_url = None
        if c.embedded_redis:
            self.say("starting redis-server (AOF, appendfsync everysec)")
            self.redis = await asyncio.to_thread(RedisServer(c.workdir / "redis").start)
            embedded_url = self.redis.url
        store_settings = c.store_settings(embedded_url)

        if c.model is None:
            self.say("building the tiny model locally (cached after the first run)")
            self.model = await asyncio.to_thread(
                ensure_model, "random", seed=1, init_std=c.model_init_std
            )
        else:
            self.model = c.model.resolve()

        replicas = c.replica_configs(self.model)
        usettings = UpdaterSettings(
            host=c.host,
            port=c.updater_port,
            admin_token=self.admin_token,
            replicas=replicas,
            provider=c.provider,
            ray=c.ray,
            **c.updater,
        )
        where = "as Ray actors" if c.provider == "ray" else "locally"
        flavor = replicas[0].launch.flavor.upper() if replicas[0].launch else "CPU"
        self.say(
            f"starting {c.replicas} vLLM {flavor} replicas {where} and bootstrapping generation "
            "g0 (about a minute on 2 cores)"
        )
        t0 = time.monotonic()
        # the updater app starts the updater (and its replicas) before it listens
        app = create_updater_app(usettings, store_settings)
        runner, port = await start_server(app, c.host, c.updater_port)
        self._runners.append(runner)
        self.say(f"replicas READY on g0 after {time.monotonic() - t0:.0f}s")
        self.updater_url = f"http://{c.host}:{port}"

        rsettings = RouterSettings(
            host=c.host,
            port=c.router_port,
            admin_token=self.admin_token,
            api_keys=c.api_keys,
            **c.router,
        )
        runner, port = await start_server(
            create_router(rsettings, store_settings), c.host, c.router_port
        )
        self._runners.append(runner)
        self.router_url = f"http://{c.host}:{port}"
        self.say(f"serving: router {self.router_url}, updater {self.updater_url}")
        return self

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.redis is not None:
            await asyncio.to_thread(self.redis.stop)
            self.redis = None
