"""``updater.app.create_app`` owns its resources like the router's app (aiohttp cleanup context):
the store client it connects and the lease its updater takes are given back when the app stops,
and when starting fails. Real Redis; the one replica is an unreachable URL, so it cannot join
(it is tainted) but the updater itself starts.

Pins: before, ``python -m updater`` never closed its store client, and a failed start kept the
lease until its TTL ran out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.checkpoint import read_manifest
from pool.errors import EngineError
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, GenerationRecord, WeightIdentity
from pool.web import start_server
from testkit.harness import publish_ready
from testkit.redis_server import RedisServer
from tests.helpers import refused_port
from updater.app import UPDATER, create_app
from updater.settings import ReplicaConfig, UpdaterSettings


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own, so its client count is this test's alone."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def settings(tmp_path: Path) -> UpdaterSettings:
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(model / "model.safetensors"))
    replica = ReplicaConfig(id="r0", url=f"http://127.0.0.1:{refused_port()}", model=model)
    return UpdaterSettings(replicas=[replica], health_interval_s=0.2)


async def clients(store: RedisStore) -> int:
    return int((await store.r.info("clients"))["connected_clients"])


async def settles_at(store: RedisStore, expected: int) -> int:
    """The client count once it stops changing to ``expected`` (a closed socket is seen by the
    server a moment after the client closes it); gives up after 5 s."""
    for _ in range(100):
        n = await clients(store)
        if n == expected:
            return n
        await asyncio.sleep(0.05)
    return n


async def assert_lease_free(store: RedisStore) -> None:
    lease = store.updater_lease("next")
    await lease.acquire(blocking_timeout_s=0)  # StoreConflict if still held
    await lease.release()


async def test_the_store_client_and_lease_are_given_back_when_the_app_stops(
    redis: RedisServer, tmp_path: Path
) -> None:
    s = settings(tmp_path)
    ss = StoreSettings(url=redis.url, namespace="app", socket_timeout_s=1.0)
    observer = RedisStore.connect(ss)
    try:
        # a published generation, so the updater starts without asking a replica for g0
        seed = observer.updater_lease("seed")
        token = await seed.acquire()
        identity = WeightIdentity(
            manifest_digest=read_manifest(s.replicas[0].model).digest, checkpoint_uri="/m"
        )
        g0 = Generation(number=0, label="g0")
        record = GenerationRecord(generation=g0, identity=identity, checkpoint="/m")
        await observer.declare_generation(record, token)
        await seed.release()
        await publish_ready(observer, [("r0", s.replicas[0].url or "")])
        before = await clients(observer)

        app = create_app(s, ss)
        runner, _ = await start_server(app)
        assert app[UPDATER].ready.is_set()
        assert await clients(observer) > before  # the app's own client
        await runner.cleanup()

        assert await settles_at(observer, before) == before
        await assert_lease_free(observer)
    finally:
        await observer.close()


async def test_a_failed_start_gives_everything_back(redis: RedisServer, tmp_path: Path) -> None:
    ss = StoreSettings(url=redis.url, namespace="app", socket_timeout_s=1.0)
    observer = RedisStore.connect(ss)
    try:
        before = await clients(observer)
        # nothing published: g0 is read from the first replica, which is unreachable
        with pytest.raises(EngineError):
            await start_server(create_app(settings(tmp_path), ss))
        assert await settles_at(observer, before) == before
        await assert_lease_free(observer)
    finally:
        await observer.close()
