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
    """Settings on the session's Redis with a fresh namespace, so tests never see each other.

    The updater lease outlives any test (600 s, five times the unit suite's per-test timeout):
    most tests take a lease without a keeper, and a test stalled past the default 15 s by a
    loaded machine then failed on a lapsed lease it never meant to test. Tests of a lapse set
    their own TTL or make it lapse."""
    return StoreSettings(
        url=redis_server.url, namespace=f"t{uuid.uuid4().hex[:12]}", updater_lease_s=600.0
    )


@pytest.fixture
async def store(store_settings: StoreSettings) -> AsyncIterator[RedisStore]:
    s = RedisStore.connect(store_settings)
    yield s
    await s.close()
