"""The pool view kept by the change feed (:mod:`pool.store.feed`): changes arrive by push, a
lost message or another history at the heartbeat's version triggers a full read, and an
unchanged pool is not read again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pool.store import RedisStore
from pool.store.feed import PoolWatch, counter
from pool.types import Generation, ReplicaState
from testkit.harness import publish_ready
from tests.helpers import begin_drain

S = ReplicaState


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)


async def test_changes_arrive_by_push_and_a_gap_rereads_everything(store: RedisStore) -> None:
    await publish_ready(store, [("r0", "http://a"), ("r1", "http://b")])
    changed: list[set[str]] = []
    w = PoolWatch(store, on_change=changed.append)
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        await until(lambda: w.read_at is not None)
        assert w.full_reads == 1 and w.latest is not None and w.latest.number == 0
        token = await store.updater_lease("u").acquire()
        await begin_drain(store, "r0", token, Generation(number=1, label="g1"), "wid:1")
        await until(lambda: w.records["r0"].state is S.DRAINING)
        assert w.full_reads == 1 and changed[-1] == {"r0"}  # pushed, not re-read
        assert w.version == await store.r.hget(store.k.version, "v")
        # a message lost: the version moves without one; the next message shows the gap
        await store.r.hincrby(store.k.version, "n", 1)
        await store.taint("r1", "x", source="test")
        await until(lambda: w.full_reads == 2)
        assert w.records["r1"].state is S.TAINTED
    finally:
        stop.set()
        await task


async def test_the_heartbeats_version_is_the_safety_net(store: RedisStore) -> None:
    """A version the watch has not applied one check later, or another history at a counter it
    has (a failover lost changes), makes it read everything; its own version does not."""
    await publish_ready(store, [("r0", "http://a")])
    w = PoolWatch(store)
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        await until(lambda: w.read_at is not None)
        mine = w.version
        w.check(mine)
        w.check(mine)
        await asyncio.sleep(0.3)  # one get_message round: nothing to do
        assert w.full_reads == 1
        w.check(f"{counter(mine)}:1")  # same counter, another history
        await until(lambda: w.full_reads == 2)
        ahead = f"{counter(mine) + 5}:1"
        w.check(ahead)  # ahead: maybe a message in flight; not yet
        await asyncio.sleep(0.3)
        assert w.full_reads == 2
        w.check(ahead)  # still not applied one check later
        await until(lambda: w.full_reads == 3)
    finally:
        stop.set()
        await task


async def test_versioned_reads_only_when_the_pool_changed(store: RedisStore) -> None:
    await publish_ready(store, [("r0", "http://a")])
    w = PoolWatch(store)
    first = await w.versioned()
    assert first["r0"].state is S.READY and w.full_reads == 1
    await w.versioned()
    assert w.full_reads == 1
    await store.taint("r0", "x", source="test")
    assert (await w.versioned())["r0"].state is S.TAINTED and w.full_reads == 2
