"""Drain reads (updater/drains.py): the records of every replica being drained, one store call
per tick, on a real Redis store."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from pool.errors import NotFound, StoreUnavailable
from pool.store import RedisStore
from pool.types import Generation, ReplicaRecord, ReplicaState
from updater.drains import DrainReads

S = ReplicaState


async def pool_of(store: RedisStore, n: int) -> list[str]:
    lease = store.updater_lease("drains")
    token = await lease.acquire()
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        await store.register_replica(rid, f"http://{rid}.test", token)
        await store.transition(
            rid, token, S.UNINITIALIZED, S.READY, generation=Generation(number=0, label="g0")
        )
    await lease.release()
    return ids


class Counted:
    """The store's read of several records, counting its calls."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.calls: list[list[str]] = []

    async def __call__(self, ids: list[str]) -> Sequence[ReplicaRecord]:
        self.calls.append(ids)
        return await self.store.replicas_of(ids)


async def test_concurrent_drains_share_one_store_read_per_tick(store: RedisStore) -> None:
    """Eight waiters asking at once get their own records from a single read of all eight
    (before, each drain read its replica on its own: N reads per tick)."""
    ids = await pool_of(store, 8)
    read = Counted(store)
    drains = DrainReads(read, every_s=0.01)
    recs = await asyncio.gather(*(drains.next(rid) for rid in ids))
    assert [r.replica_id for r in recs] == ids
    assert all(r.state is S.READY for r in recs)
    assert read.calls == [ids]


async def test_each_tick_reads_after_the_ask(store: RedisStore) -> None:
    """A record asked for after a change is read after it: the next tick's, never an older
    one kept from an earlier tick."""
    (rid,) = await pool_of(store, 1)
    drains = DrainReads(store.replicas_of, every_s=0.01)
    assert (await drains.next(rid)).state is S.READY
    token = await (lease := store.updater_lease("drains-2")).acquire()
    await store.transition(rid, token, S.READY, S.TAINTED, reason="test")
    await lease.release()
    assert (await drains.next(rid)).state is S.TAINTED


async def test_an_unknown_replica_is_not_found_and_the_others_are_answered(
    store: RedisStore,
) -> None:
    (rid,) = await pool_of(store, 1)
    drains = DrainReads(store.replicas_of, every_s=0.01)
    known, unknown = await asyncio.gather(
        drains.next(rid), drains.next("nobody"), return_exceptions=True
    )
    assert isinstance(known, ReplicaRecord) and known.replica_id == rid
    assert isinstance(unknown, NotFound)


async def test_a_failed_read_fails_every_waiter_of_its_tick_and_the_next_tick_reads_again(
    store: RedisStore,
) -> None:
    ids = await pool_of(store, 2)
    fail = True

    async def read(asked: list[str]) -> Sequence[ReplicaRecord]:
        if fail:
            raise StoreUnavailable("redis away")
        return await store.replicas_of(asked)

    drains = DrainReads(read, every_s=0.01)
    outs = await asyncio.gather(*(drains.next(rid) for rid in ids), return_exceptions=True)
    assert all(isinstance(o, StoreUnavailable) for o in outs)
    fail = False
    assert (await drains.next(ids[0])).replica_id == ids[0]


async def test_a_cancelled_waiter_leaves_the_others_answered(store: RedisStore) -> None:
    ids = await pool_of(store, 2)
    drains = DrainReads(store.replicas_of, every_s=0.05)
    gone = asyncio.create_task(drains.next(ids[0]))
    kept = asyncio.create_task(drains.next(ids[1]))
    await asyncio.sleep(0)
    gone.cancel()
    assert (await kept).replica_id == ids[1]
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_cancelling_the_ticker_cancels_its_waiters_instead_of_leaving_them_hanging(
    store: RedisStore,
) -> None:
    (rid,) = await pool_of(store, 1)
    drains = DrainReads(store.replicas_of, every_s=60.0)
    waiter = asyncio.create_task(drains.next(rid))
    await asyncio.sleep(0)
    assert drains._ticker is not None
    drains._ticker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 5)


async def test_a_tick_whose_waiters_all_left_reads_nothing(store: RedisStore) -> None:
    """Waiters cancelled before their tick (the updater stopping its cycles) cost no read."""
    ids = await pool_of(store, 2)
    read = Counted(store)
    drains = DrainReads(read, every_s=0.05)
    waiters = [asyncio.create_task(drains.next(rid)) for rid in ids]
    await asyncio.sleep(0)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert drains._ticker is not None
    await drains._ticker
    assert read.calls == []
