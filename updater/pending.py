"""Updates that were pushed and have not finished yet.

:class:`PendingUpdates` keeps them in push order for the one update worker and answers lookups
while they are live; a finished update leaves it (its record stays in the store, which is where
:meth:`updater.service.Updater.get` finds it afterwards). Not thread-safe; one event loop. Any
task may add and look up; only the worker takes and finishes.
"""

from __future__ import annotations

import asyncio
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
        self._queue.task_done()

    def record(self, update_id: str) -> UpdateRecord | None:
        live = self._live.get(update_id)
        return None if live is None else live.record

    def generations(self) -> list[int]:
        """Generation numbers allocated to live updates (not declared in the store yet)."""
        return [u.record.generation for u in self._live.values()]

    def labels(self) -> dict[str, int]:
        """Label -> generation number of the live updates."""
        return {u.record.label: u.record.generation for u in self._live.values()}

    def newest_queued_after(self, update: PendingUpdate) -> int | None:
        """The newest generation queued behind ``update``, if any (it supersedes ``update``)."""
        newer = [
            u.record.generation
            for u in self._live.values()
            if u.record.state is UpdateState.QUEUED
            and u.record.generation > update.record.generation
        ]
        return max(newer, default=None)

    async def join(self) -> None:
        """Wait until every update added so far has been finished."""
        await self._queue.join()


__all__ = ["PendingUpdate", "PendingUpdates"]
