"""Reusable helpers (not fixtures) for router tests and benchmarks.

* :func:`start_replicas` — N real vLLM CPU servers of the tiny model via :mod:`pool.launcher`
  (float32, eager, 64 MiB KV cache, one core each, ``--enable-scale-out`` so
  ``/inference/v1/generate`` exists); chat completions use the model's own chat template.
* :func:`label_replicas` + :func:`publish_ready` — act as the updater: set each engine's weight
  label, then register the replicas and move them ``UNINITIALIZED → READY`` on generation g0
  under an updater lease, publishing it.
* :func:`serve_router` — the router app on a real port (handler cancellation on, as in
  production); :func:`router_client` — the same app behind aiohttp's test client (unit tests).
* :func:`local_launcher` — the launcher of a replica an updater runs with the ``local``
  provider (tests signal its process group).

Servers take 20-60 s to start on a busy 2-core box; timeouts here are generous.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pool.checkpoint import content_hash, read_manifest
from pool.engine import VllmEngine
from pool.errors import NotFound
from pool.launcher import LocalReplica, ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Binding, BindingState, Generation, ReplicaState, WeightIdentity
from pool.web import start_server
from rolloutpool.local.models import (
    CHAT_TEMPLATE as CHAT_TEMPLATE,  # the tiny models' own (stand-ins)
)
from rolloutpool.local.models import ensure_model
from router.app import create_app
from router.settings import RouterSettings
from updater.providers.local import LocalProvider
from updater.service import Updater

G0 = Generation(number=0, label="g0")


def local_launcher(updater: Updater, replica_id: str) -> LocalReplica:
    """The launcher of ``replica_id`` in an updater whose provider is ``local``."""
    provider = updater.provider
    assert isinstance(provider, LocalProvider), f"{provider.name} provider, not local"
    return provider.launcher(replica_id)


def tiny_model() -> Path:
    """Tiny random Llama A (seed 1), built once and cached."""
    return ensure_model("random", seed=1)


def identity_of(model: Path) -> WeightIdentity:
    return WeightIdentity(
        manifest_digest=read_manifest(model).digest,
        checkpoint_uri=str(model),
        content_hash=content_hash(model),
    )


async def start_replicas(
    model: Path,
    n: int,
    work_root: Path,
    *,
    name: str = "router-itest",
    startup_timeout_s: float = 420.0,
    env: Mapping[str, str] | None = None,
    max_model_len: int = 512,
) -> list[LocalReplica]:
    """Start ``n`` replicas concurrently (core ``i % 2`` each); all or nothing.

    ``env`` is added to each server's environment; ``max_model_len`` is each server's context
    (the tiny models have 4096 positions). If any replica fails to start, the others
    are stopped and the error is raised.
    """
    replicas = [
        LocalReplica(
            ReplicaSpec(
                model=model,
                name=f"{name}-{i}",
                cpu_bind=str(i % 2),
                enable_scale_out=True,
                work_dir=work_root / f"replica-{i}",
                startup_timeout_s=startup_timeout_s,
                env=dict(env or {}),
                max_model_len=max_model_len,
            )
        )
        for i in range(n)
    ]
    results = await asyncio.gather(*(r.start() for r in replicas), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await stop_replicas(replicas)
        raise failures[0]
    return replicas


async def stop_replicas(replicas: Sequence[LocalReplica]) -> None:
    await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)


async def label_replicas(urls: Sequence[str], label: str) -> None:
    """``/update_weight_version`` on each replica (what the updater does before READY)."""
    for url in urls:
        async with VllmEngine(url, timeout=60.0) as engine:
            await engine.bootstrap()
            ev = await engine.set_label(label)
            assert ev.label == label, ev


async def publish_ready(
    store: RedisStore,
    replicas: Sequence[tuple[str, str]],
    *,
    generation: Generation = G0,
    identity_digest: str = "wid:test",
    capacity: int = 64,
) -> None:
    """Register ``(replica_id, url)`` pairs and make them READY on ``generation`` (published).

    Holds the updater lease only for the duration of the call.
    """
    lease = store.updater_lease("harness")
    token = await lease.acquire(blocking_timeout_s=30)
    try:
        for rid, url in replicas:
            await store.register_replica(rid, url, token, capacity=capacity)
            await store.transition(
                rid,
                token,
                ReplicaState.UNINITIALIZED,
                ReplicaState.READY,
                generation=generation,
                identity_digest=identity_digest,
                publish=True,
            )
    finally:
        await lease.release()


async def settled(
    store: RedisStore,
    rollout_id: str,
    until: Callable[[Binding], bool] | None = None,
    timeout_s: float = 10.0,
) -> Binding:
    """The rollout's binding once it has ended (or once ``until`` holds), polling.

    The router releases a binding right after the last byte of a successful answer, and writes
    the record of a rollout run under a grant a moment after delivery (``record_flush_s``), so
    a client that has its answer may still see the binding active, or no record, for a moment.
    """
    done = until or (lambda b: b.state is not BindingState.ACTIVE)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            b = await store.binding(rollout_id)
        except NotFound:
            if time.monotonic() > deadline:
                raise
        else:
            if done(b) or time.monotonic() > deadline:
                return b
        await asyncio.sleep(0.02)


@dataclass
class RunningRouter:
    app: web.Application
    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.runner.cleanup()


async def serve_router(
    settings: RouterSettings, store_settings: StoreSettings, host: str = "127.0.0.1"
) -> RunningRouter:
    app = create_app(settings, store_settings)
    runner, port = await start_server(app, host, settings.port)
    return RunningRouter(app, runner, f"http://{host}:{port}")


@contextlib.asynccontextmanager
async def router_client(
    settings: RouterSettings, store_settings: StoreSettings
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """The router app, started, behind aiohttp's test client (handler cancellation is on)."""
    async with TestClient(TestServer(create_app(settings, store_settings))) as client:
        yield client
