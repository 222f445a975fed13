"""``rolloutpool status`` against a real router (real Redis, no vLLM).

Pins: it read ``latest.number`` from ``/v1/pool``, whose published generation is
``latest.generation``, and printed ``-``."""

from __future__ import annotations

import asyncio

import pytest

from pool.settings import StoreSettings
from pool.store import RedisStore
from rolloutpool.cli import _status
from router.settings import RouterSettings
from testkit.harness import publish_ready, serve_router


async def test_status_prints_the_published_generation(
    store_settings: StoreSettings, store: RedisStore, capsys: pytest.CaptureFixture[str]
) -> None:
    await publish_ready(store, [("r0", "http://127.0.0.1:1")])
    router = await serve_router(RouterSettings(port=0), store_settings)
    try:
        assert await asyncio.to_thread(_status, router.url) == 0
    finally:
        await router.stop()
    out = capsys.readouterr().out
    assert "published generation: 0 (g0)" in out
    assert "r0" in out and "READY" in out
