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

:func:`load_config` is how a config is read: every mistake (an unknown key, a key in the wrong
section or one the pool sets itself, a bad value, here or in the ``ROLLOUTPOOL_*`` environment
the services read) is refused before anything starts, as a :class:`ConfigError` whose problems
are one line each, naming the key and where it belongs.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from pool.launcher import ReplicaSpec
from pool.paths import default_cache_root
from pool.settings import StoreSettings
from pool.web import start_server
from rolloutpool.local.models import ensure_model
from rolloutpool.local.redis import RedisServer
from router.app import create_app as create_router
from router.settings import RouterSettings
from updater.app import create_app as create_updater_app
from updater.providers.config import RayConfig
from updater.settings import ReplicaConfig, UpdaterSettings

Progress = Callable[[str], None]

#: ReplicaSpec fields the pool sets per replica (not overridable through ``PoolConfig.replica``).
_PER_REPLICA = frozenset({"name", "port", "work_dir"})

#: The sections of a config: the class whose fields each one holds.
_SECTIONS: dict[str, type[BaseModel]] = {
    "router": RouterSettings,
    "updater": UpdaterSettings,
    "redis": StoreSettings,
    "replica": ReplicaSpec,
    "ray": RayConfig,
}
#: Fields of a section that the pool sets from a top-level key: section -> field -> that key.
_FROM_TOP: dict[str, dict[str, str]] = {
    "router": {
        "host": "host",
        "port": "router_port",
        "admin_token": "admin_token",
        "api_keys": "api_keys",
    },
    "updater": {
        "host": "host",
        "port": "updater_port",
        "admin_token": "admin_token",
        "replicas": "replicas",
        "provider": "provider",
        "ray": "ray",
    },
    "redis": {"url": "redis_url", "namespace": "namespace"},
    "replica": {"model": "model"},
}


class ConfigError(ValueError):
    """A pool config that cannot run; ``problems`` are one line each, naming the key
    (``router.api_keys``) and what to do about it."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def _settable(section: str) -> list[str]:
    """The keys a config gives under ``section``."""
    pool_sets = _FROM_TOP.get(section, {}).keys() | (
        _PER_REPLICA if section == "replica" else set()
    )
    return [k for k in _SECTIONS[section].model_fields if k not in pool_sets]


def _unknown(dotted: str, known: Sequence[str], places: Sequence[str]) -> str:
    """The line for an unknown key ``dotted``: where it belongs, else the nearest known key,
    else the known keys."""
    key = dotted.rsplit(".", 1)[-1]
    if places:
        return f"unknown key {dotted}: it belongs {' or '.join(places)}"
    close = get_close_matches(key, known, n=2)
    if close:
        return f"unknown key {dotted} (did you mean {' or '.join(close)}?)"
    return f"unknown key {dotted}; the keys there are {', '.join(sorted(known))}"


def _places(key: str, besides: str | None) -> list[str]:
    """Where ``key`` belongs in a config (the top level, ``under router:``, ...), other than
    the section ``besides`` (None: the top level)."""
    places = ["at the top level"] if besides is not None and key in PoolConfig.model_fields else []
    return places + [f"under {s}:" for s in _SECTIONS if s != besides and key in _settable(s)]


def _misplaced(section: str, values: Mapping[str, Any]) -> list[str]:
    """The keys of ``section`` that a config cannot give there."""
    model = _SECTIONS[section]
    problems = []
    for key in values:
        dotted = f"{section}.{key}"
        top = _FROM_TOP.get(section, {}).get(key)
        if top is not None:
            what = " (the count; launch fields go under replica:)" if top == "replicas" else ""
            problems.append(
                f"{dotted} belongs at the top level, as {top}{what}, not under {section}:"
            )
        elif section == "replica" and key in _PER_REPLICA:
            problems.append(f"{dotted} is set by the pool for each replica: leave it out")
        elif key not in model.model_fields:
            problems.append(_unknown(dotted, _settable(section), _places(key, section)))
    return problems


def _message(e: ErrorDetails) -> str:
    return e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _model_at(loc: Sequence[str]) -> type[BaseModel] | None:
    """The model the key at ``loc`` (a path of field names from the top level) is a field of."""
    model: type[BaseModel] = PoolConfig
    for name in loc:
        field = model.model_fields.get(name)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def explain(error: ValidationError) -> list[str]:
    """The problems of a :class:`PoolConfig` validation, one line each, naming the key."""
    problems: list[str] = []
    for e in error.errors():
        loc = [str(x) for x in e["loc"]]
        dotted = ".".join(loc)
        if e["type"] == "pool_config":
            problems.append(e["msg"])
        elif e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            known = list(model.model_fields) if model is not None else []
            places = _places(loc[-1], loc[0] if len(loc) == 2 else None) if len(loc) <= 2 else []
            problems.append(_unknown(dotted, known, places))
        else:
            problems.append(f"{dotted}: {_message(e)}" if dotted else _message(e))
    return problems


def _refuse(problems: Sequence[str]) -> None:
    if problems:
        raise PydanticCustomError("pool_config", "{problems}", {"problems": "; ".join(problems)})


class PoolConfig(BaseModel):
    """``rolloutpool up`` configuration (YAML). ``redis_url`` None and no ``redis.sentinels`` =
    embedded redis-server; ``redis`` holds further :class:`~pool.settings.StoreSettings` fields,
    e.g. ``{sentinels: [h1:26379, h2:26379, h3:26379], sentinel_service: rolloutpool,
    wait_replicas: 1}`` for a Redis that fails over (docs: operations/failover.md).

    Unknown keys are refused, here and in the sections; so are section keys the pool sets from
    a top-level one (``router.api_keys``: give ``api_keys``). The sections' values are checked
    by :meth:`check_settings` (:func:`load_config` runs it)."""

    model_config = ConfigDict(extra="forbid")

    # Redis data, checkpoints, logs: under the cache directory (pool.paths.default_cache_root)
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

    @field_validator("router", "updater", "redis")
    @classmethod
    def _section_keys(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        _refuse(_misplaced(str(info.field_name), v))
        return v

    @field_validator("replica")
    @classmethod
    def _replica_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        _refuse(_misplaced("replica", v))
        # bad values are refused now, not when the pool starts
        try:
            ReplicaSpec(model=Path("/"), **v)
        except ValidationError as e:
            _refuse([f"replica.{x}" for x in explain(e)])
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

    def router_settings(self, admin_token: str) -> RouterSettings:
        """The router's settings (the ``ROLLOUTPOOL_ROUTER_*`` environment below ``router``)."""
        return RouterSettings(
            host=self.host,
            port=self.router_port,
            admin_token=admin_token,
            api_keys=self.api_keys,
            **self.router,
        )

    def updater_settings(self, admin_token: str, model: Path) -> UpdaterSettings:
        """The updater's settings, its replicas serving ``model`` (the
        ``ROLLOUTPOOL_UPDATER_*`` environment below ``updater``)."""
        return UpdaterSettings(
            host=self.host,
            port=self.updater_port,
            admin_token=admin_token,
            replicas=self.replica_configs(model),
            provider=self.provider,
            ray=self.ray,
            **self.updater,
        )

    def check_settings(self) -> None:
        """Build the router's, the updater's and the store's settings as
        :meth:`EmbeddedPool.start` does, environment included, so that a bad value is refused
        before anything starts. Raises :class:`ConfigError` naming each bad key: ``router.x``
        for a section's, the top-level key for one the pool sets, the environment variable
        for one that came from there."""
        token = self.admin_token or secrets.token_urlsafe(18)
        builds: dict[str, Callable[[], object]] = {
            "router": lambda: self.router_settings(token),
            "updater": lambda: self.updater_settings(token, self.model or Path("/model")),
            "redis": lambda: self.store_settings(
                "redis://127.0.0.1:6379/0" if self.embedded_redis else None
            ),
        }
        problems: list[str] = []
        for section, build in builds.items():
            try:
                build()
            except ValidationError as e:
                problems += [self._where(section, x) for x in e.errors()]
            except ValueError as e:
                problems.append(f"{section}: {e}")
        if problems:
            raise ConfigError(problems)

    def _where(self, section: str, e: ErrorDetails) -> str:
        """One line for an error of ``section``'s settings class, naming where the key was."""
        loc = [str(x) for x in e["loc"]]
        msg = _message(e)
        if not loc:
            return f"{section}: {msg}"
        dotted = ".".join(loc)
        given: dict[str, Any] = getattr(self, section)
        if loc[0] in given:
            return f"{section}.{dotted}: {msg}"
        top = _FROM_TOP.get(section, {}).get(loc[0])
        if top is not None:
            return f"{top}: {msg}"
        prefix = str(_SECTIONS[section].model_config.get("env_prefix", ""))
        name = (prefix + loc[0]).upper()
        if any(k.upper().startswith(name) for k in os.environ):
            return f"{name} (from the environment): {msg}"
        return f"{section}.{dotted}: {msg}"

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


def load_config(data: Mapping[str, Any]) -> PoolConfig:
    """The config ``data`` holds (a YAML file's mapping), checked whole: raises
    :class:`ConfigError` with every problem found, one line each."""
    try:
        config = PoolConfig.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(explain(e)) from None
    config.check_settings()
    return config


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

        usettings = c.updater_settings(self.admin_token, self.model)
        replicas = usettings.replicas
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

        rsettings = c.router_settings(self.admin_token)
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
