"""Updates that were pushed and have not finished yet.

:class:`PendingUpdates` keeps them in push order for the one update worker and answers lookups
while they are live; a finished update leaves it (its record stays in the store, which is where
:meth:`updater.service.Updater.get` finds it afterwards). Not thread-safe; one event loop. Any
task may add and look up; only the worker takes and finishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pool.records import UpdateRecord, UpdateState
from updater.cycle import UpdateTarget


@dataclass
class PendingUpdate:
    """One pushed update: its record (mutated as it progresses) and what to roll out."""

    record: UpdateRecord
    target: UpdateTarget


class PendingUpdates:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[PendingUpdate] = asyncio.Queue()
        self._live: dict[str, PendingUpdate] = {}

    def add(self, update: PendingUpdate) -> None:
        self._live[update.record.id] = update
        self._queue.put_nowait(update)

    async def take(self) -> PendingUpdate:
        """The oldest update not yet taken (waits for one)."""
        return await self._queue.get()

    def finish(self, update: PendingUpdate) -> None:
        """The worker is done with ``update`` (whatever its outcome)."""
        self._live.pop(update.record.id, None)

    def record(self, update_id: str) -> UpdateRecord | None:
        live = self._live.get(update_id)
        return None if live is None else live.record

    def generations(self) -> list[int]:
        """Generation numbers allocated to live updates (not declared in the store yet)."""
        return [u.record.generation for u in self._live.values()]

    def labels(self) -> dict[str, int]:
        """Label -> generation number of the live updates."""
        return {u.record.label: u.record.generation for u in self._live.values()}

    def unfinished(self) -> list[PendingUpdate]:
        """The live updates whose records are not final yet (queued or running)."""
        return [u for u in self._live.values() if not u.record.state.final]

    def newest_queued_after(self, update: PendingUpdate) -> int | None:
        """The newest generation queued behind ``update``, if any (it supersedes ``update``)."""
        newer = [
            u.record.generation
            for u in self._live.values()
            if u.record.state is UpdateState.QUEUED
            and u.record.generation > update.record.generation
        ]
        return max(newer, default=None)


class RecordSaver:
    """Saves one running update's record in the background, at most once per ``interval_s``.

    Replicas report progress at every phase, and the record holds every replica's report, so
    saving it on each report cost O(N) per phase, O(N²) per update, on the cycles' critical
    path (bench/scale at N=128: ~35 KB of JSON per save). :meth:`changed` only marks the record
    dirty; one task saves the latest state. Readers of a live update get it from memory
    (:meth:`updater.service.Updater.get`); the stored copy lags by at most ``interval_s``.
    ``save`` must not raise (the updater's logs and drops a failed save). :meth:`close` saves
    what is pending and stops; after it, :meth:`changed` is ignored. One event loop.
    """

    def __init__(
        self,
        record: UpdateRecord,
        save: Callable[[UpdateRecord], Awaitable[None]],
        interval_s: float = 0.25,
    ) -> None:
        self.record, self._save, self.interval_s = record, save, interval_s
        self._dirty = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def changed(self) -> None:
        self._dirty.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._dirty.is_set():
            self._dirty.clear()
            await self._save(self.record)

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await asyncio.shield(self._save(self.record))  # a save in flight completes
            await asyncio.sleep(self.interval_s)


__all__ = ["PendingUpdate", "PendingUpdates", "RecordSaver"]
