"""Shared fixtures: a real ``redis-server`` per test session on a free port (no system service)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


@pytest.fixture
def store_settings(redis_server: RedisServer) -> StoreSettings:
    """Settings on the session's Redis with a fresh namespace, so tests never see each other."""
    return StoreSettings(url=redis_server.url, namespace=f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def store(store_settings: StoreSettings) -> AsyncIterator[RedisStore]:
    s = RedisStore.connect(store_settings)
    yield s
    await s.close()
