"""The updater's epoch gate before a transfer (:class:`updater.failover.EpochGate`) on a real
redis-server: Redis unreachable for a moment is waited out, not taken for a failed update."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from pool.errors import StoreUnavailable
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.redis_server import RedisServer
from updater.failover import EpochGate


async def test_a_redis_restart_during_the_check_is_waited_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Pins the fix of the reliability scenario's failure: the update pushed after a Redis
    outage was cancelled at "failover check: Redis ... is unreachable" on the first error."""
    server = RedisServer(tmp_path / "redis").start()
    store = RedisStore.connect(StoreSettings(url=server.url, namespace="gate"))
    try:
        before = await EpochGate(store).settled()
        server.stop()
        caplog.set_level(logging.INFO, logger="updater.failover")
        check = asyncio.create_task(EpochGate(store, poll_s=0.05, timeout_s=60).settled())
        deadline = time.monotonic() + 30
        while "trying again" not in caplog.text and not check.done():
            assert time.monotonic() < deadline, "the gate never reached Redis"
            await asyncio.sleep(0.02)
        assert not check.done(), check.exception()  # it failed once and keeps waiting
        await asyncio.to_thread(server.start)  # same port, same data (AOF)
        after = await asyncio.wait_for(check, 30)
        assert after.number >= before.number
    finally:
        await store.close()
        server.stop()


async def test_the_wait_is_bounded(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    store = RedisStore.connect(StoreSettings(url=server.url, namespace="gate"))
    try:
        server.stop()
        with pytest.raises(StoreUnavailable):
            await EpochGate(store, poll_s=0.05, timeout_s=0.3).settled()
    finally:
        await store.close()


async def test_a_deadline_ends_the_wait_even_when_the_cancelled_call_says_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit run hung for 120 s in ``wait_for(gate.settled(), 0.5)`` on a Sentinel store: the
    cancelled epoch read surfaced as StoreUnavailable, which the gate waits out (up to
    timeout_s, 30 min there). Here the read is made to do exactly that on cancellation."""
    server = RedisServer(tmp_path / "redis").start()
    store = RedisStore.connect(StoreSettings(url=server.url, namespace="gate"))
    real = store.failover.epoch
    hang = asyncio.Event()

    async def epoch_that_hides_cancellation() -> object:
        if not hang.is_set():
            return await real()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise StoreUnavailable("Redis is unreachable (ConnectionError)") from None
        raise AssertionError("not reached")

    monkeypatch.setattr(store.failover, "epoch", epoch_that_hides_cancellation)
    try:
        gate = EpochGate(store, poll_s=0.02, timeout_s=600)
        await gate.settled()
        hang.set()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.wait_for(gate.settled(), 0.2), 10)
        assert time.monotonic() - t0 < 5  # the inner deadline, not the 10 s guard
    finally:
        await store.close()
        server.stop()
