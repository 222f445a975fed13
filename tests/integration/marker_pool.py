"""One real vLLM CPU replica of a marker model, driven by a :class:`CycleRunner` the way the
updater drives it (``test_cycle``, ``test_checksum_validation``).

A marker checkpoint ``g`` answers every prompt with the token :func:`marker_token` ``(g)``, so
the tokens of a rollout name the generation that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.launcher import LocalReplica, ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore, UpdaterLease
from pool.types import Generation, WeightIdentity
from rolloutpool.local.models import ensure_model, marker_token
from updater.cycle import CycleRunner, Deadlines, Probe, ReplicaHandle, UpdateTarget
from updater.transports.base import Transport

PROMPT = tuple(range(10, 40))


def marker_dir(g: int) -> Path:
    return ensure_model("marker", token_id=marker_token(g))


def target(g: int, path: Path | None = None, expected: int | None = None) -> UpdateTarget:
    """Generation ``g`` (label ``g<g>``) from ``path`` (default: marker ``g``), probed for the
    marker token of ``expected`` (default ``g``)."""
    path = path or marker_dir(g)
    ident = WeightIdentity(
        manifest_digest=read_manifest(path).digest, checkpoint_uri=str(path), step=g
    )
    tok = marker_token(g if expected is None else expected)
    return UpdateTarget(Generation(number=g, label=f"g{g}"), ident, path, Probe(PROMPT, (tok,) * 4))


@dataclass
class Pool:
    replica: LocalReplica
    store: RedisStore
    lease: UpdaterLease
    runner: CycleRunner
    handle: ReplicaHandle


@contextlib.asynccontextmanager
async def marker_pool(
    redis_url: str,
    work_dir: Path,
    name: str,
    transport: Transport,
    *,
    extra_args: tuple[str, ...] = (),
    bootstrap_checkpoint: bool = False,
) -> AsyncIterator[Pool]:
    """Replica ``r0`` (core 1) serving marker 0, registered in namespace ``name`` under a held
    updater lease and bootstrapped on ``g0`` (reloading marker 0 first if
    ``bootstrap_checkpoint``). Blocks for the server's start (20-45 s on 2 cores); everything
    is stopped on exit."""
    spec = ReplicaSpec(
        model=marker_dir(0), name=name, cpu_bind="1", work_dir=work_dir, extra_args=extra_args
    )
    replica = LocalReplica(spec)
    await replica.start()
    store = RedisStore.connect(StoreSettings(url=redis_url, namespace=name))
    lease = store.updater_lease("test")
    token = await lease.acquire()
    keep = asyncio.create_task(lease.keep_alive())
    engine = VllmEngine(replica.url, timeout=60.0)
    handle = ReplicaHandle("r0", engine, read_manifest(marker_dir(0)))
    runner = CycleRunner(store, lease, transport, deadlines=Deadlines(transfer_s=30))
    await store.register_replica("r0", replica.url, token)
    t0 = target(0)
    checkpoint = t0.path if bootstrap_checkpoint else None
    await runner.bootstrap(handle, t0.generation, t0.identity, t0.probe, checkpoint=checkpoint)
    try:
        yield Pool(replica, store, lease, runner, handle)
    finally:
        keep.cancel()
        await engine.aclose()
        await lease.release()
        await store.close()
        await replica.stop()
