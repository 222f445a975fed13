"""Every drain in progress read from the store in one call per tick.

A cycle's drain waits until its replica is idle (I2), reading the replica's record every
``every_s``. With k cycles draining at once (a wide wave; a strict pool's first wave is the whole
pool) that is k reads per tick, each a pipelined round trip and a record to parse: at 64 replicas
and a 20 ms tick, more than one event loop can do, and every other step of every cycle in the
updater waits behind them. :class:`DrainReads` gathers them: a waiter asks for its replica's
record of the next tick (:meth:`DrainReads.next`), and each tick reads every replica asked for
in one store call.

Contract: :meth:`~DrainReads.next` returns a record read after it was called, about ``every_s``
later (plus the read). An error of a tick's read is raised in every waiter of that tick; a
replica the store does not know is :class:`~pool.errors.NotFound` to its waiters. A waiter
cancelled meanwhile is dropped. The ticking task runs only while someone waits and ends by
itself; cancelled, it cancels its waiters. One instance serves one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from pool.errors import NotFound
from pool.types import ReplicaRecord

#: Reads the records of the given replica ids (those that exist).
ReadMany = Callable[[list[str]], Awaitable[Sequence[ReplicaRecord]]]


class DrainReads:
    def __init__(self, read: ReadMany, every_s: float) -> None:
        self._read = read
        self.every_s = every_s
        self._waiting: dict[str, list[asyncio.Future[ReplicaRecord]]] = {}
        self._taken: dict[str, list[asyncio.Future[ReplicaRecord]]] = {}  # the tick's read
        self._ticker: asyncio.Task[None] | None = None

    async def next(self, replica_id: str) -> ReplicaRecord:
        """``replica_id``'s record as the next tick reads it."""
        fut: asyncio.Future[ReplicaRecord] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(replica_id, []).append(fut)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="drain-reads")
            self._ticker.add_done_callback(self._ended)
        return await fut

    async def _tick(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.every_s)
            self._taken = {
                rid: live
                for rid, futs in self._waiting.items()
                if (live := [f for f in futs if not f.done()])  # not cancelled meanwhile
            }
            self._waiting = {}
            if not self._taken:
                continue  # nobody waits any more (e.g. the updater stopped): no read
            try:
                found = {r.replica_id: r for r in await self._read(sorted(self._taken))}
            except Exception as e:
                _settle(self._taken, {}, e)
            else:
                _settle(self._taken, found, None)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The ticker ended (cancelled even before it ran, or nobody waits): nobody is left
        waiting for a tick that will not come. A newer ticker's waiters are its own."""
        if task is not self._ticker:
            return
        for futs in (*self._taken.values(), *self._waiting.values()):
            for f in futs:
                f.cancel()  # no-op on a settled one
        self._taken, self._waiting = {}, {}


def _settle(
    waiting: dict[str, list[asyncio.Future[ReplicaRecord]]],
    found: dict[str, ReplicaRecord],
    error: Exception | None,
) -> None:
    """Each waiter gets ``error``, else its replica's record, else NotFound."""
    for rid, futs in waiting.items():
        rec = found.get(rid)
        for f in futs:
            if f.done():  # its waiter was cancelled meanwhile
                continue
            if error is not None:
                f.set_exception(error)
            elif rec is None:
                f.set_exception(NotFound(f"unknown replica {rid}", replica=rid))
            else:
                f.set_result(rec)
