"""The pool view kept current by a change feed instead of re-read on a timer.

Every script that changes a replica's record or the published generation (``TRANSITION``,
``TAINT``, ``REGISTER``, ``ABORT_GRANTS``) moves the view's **version** (``{ns}:version``:
``"<counter>:<server time in us>"``) and publishes ``"<version>:<replica id>"`` on
``{ns}:changes`` in the same atomic step. A :class:`PoolWatch`:

* subscribes, then reads the whole view once (so no change falls between the two);
* on each message re-reads that one replica and the published generation (O(changes), not
  O(N)); a message whose counter skips one (a message lost) triggers a full re-read;
* is told the version Redis holds now by :meth:`check` (routers get it with their failover
  heartbeat, every tick, for no extra command): a version it has still not applied one check
  later, or another history at the same counter (a failover lost changes: the time part
  differs), triggers a full re-read. That is the safety net: a lost message, a dropped
  subscription or a failover costs at most one check interval of staleness, and an idle pool
  costs no command at all beyond the heartbeat, whatever its size;
* re-reads in full whenever it (re)subscribes.

:meth:`versioned` serves a process with no feed task (the updater's supervisor): one read of
the version, and the whole view only when it moved.

Not thread-safe; one event loop. :meth:`run` stops on a flag, never by cancellation (redis-py
may swallow a cancellation mid-command; see :mod:`router.bindings`). Reads may raise
:class:`~pool.errors.StoreUnavailable`; :meth:`run` retries them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from pool.errors import StoreError
from pool.types import Generation, ReplicaRecord

if TYPE_CHECKING:
    from pool.store._store import RedisStore

log = logging.getLogger("pool.store.feed")


def counter(version: str) -> int:
    """The counter part of a version (0 for ``''``, before the first change)."""
    head = version.partition(":")[0]
    return int(head) if head.isdigit() else 0


class PoolWatch:
    """The replicas and the published generation, as of :attr:`version` (see the module doc).

    ``on_change(ids)`` is called (synchronously) after every update of the view with the ids
    whose records were re-read (every id after a full read).
    """

    def __init__(
        self,
        store: RedisStore,
        on_change: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.store = store
        self.on_change = on_change
        self.records: dict[str, ReplicaRecord] = {}
        self.latest: Generation | None = None
        self.version = ""
        #: monotonic time of the last full read (None before the first)
        self.read_at: float | None = None
        self.full_reads = 0
        self._seen: str | None = None
        self._stale = asyncio.Event()
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ reads

    async def full(self) -> None:
        """Read the whole view (the version first: the records are at least that new)."""
        async with self._lock:
            version = await self._version()
            records, latest = await asyncio.gather(self.store.replicas(), self.store.latest())
            self.records = {r.replica_id: r for r in records}
            self.latest = latest[0] if latest else None
            self.version = version
            self.read_at = time.monotonic()
            self.full_reads += 1
            self._seen = None  # what earlier checks saw is covered now
            self._stale.clear()
        if self.on_change is not None:
            self.on_change(set(self.records))

    async def versioned(self) -> dict[str, ReplicaRecord]:
        """The records, read in full only if the version moved since the last read."""
        if self.read_at is None or await self._version() != self.version:
            await self.full()
        return self.records

    async def _one(self, version: str, replica_id: str) -> None:
        async with self._lock:
            if counter(version) <= counter(self.version):
                return  # a full read after it already covers it
            recs, latest = await asyncio.gather(
                self.store._replicas([replica_id]) if replica_id else _none(),
                self.store.latest(),
            )
            if replica_id:
                if recs:
                    self.records[replica_id] = recs[0]
                else:
                    self.records.pop(replica_id, None)
            self.latest = latest[0] if latest else None
            self.version = version
        if self.on_change is not None and replica_id:
            self.on_change({replica_id})

    async def _version(self) -> str:
        raw = await self.store.call(lambda: self.store.r.hget(self.store.k.version, "v"))
        return str(raw or "")

    # ------------------------------------------------------------------ safety net

    def check(self, version: str) -> None:
        """Redis holds ``version`` now: schedule a full read if a version seen one check ago is
        still not applied, or if ``version`` is another history at a counter already applied."""
        previous, self._seen = self._seen, version
        if version == self.version:
            return
        if (previous is not None and not self._covers(previous)) or counter(version) <= counter(
            self.version
        ):
            self._stale.set()

    def _covers(self, version: str) -> bool:
        mine, theirs = counter(self.version), counter(version)
        return mine > theirs or (mine == theirs and self.version == version)

    # ------------------------------------------------------------------ the feed

    async def run(self, stop: asyncio.Event, retry_s: float = 0.5) -> None:
        """Follow the change feed until ``stop`` is set (subscribe, read in full, apply
        messages; on any error wait ``retry_s`` and start over)."""
        while not stop.is_set():
            try:
                await self._follow(stop)
            except (StoreError, RedisError, OSError) as e:
                log.warning("pool view feed: %s; subscribing again", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), retry_s)

    async def _follow(self, stop: asyncio.Event) -> None:
        pubsub = self.store.r.pubsub()
        try:
            await pubsub.subscribe(self.store.k.changes)
            await self.full()
            while not stop.is_set():
                if self._stale.is_set():
                    await self.full()
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                if msg is not None:
                    await self._apply(msg)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    async def _apply(self, msg: dict[str, Any]) -> None:
        data = msg.get("data")
        text = data.decode() if isinstance(data, bytes) else str(data)
        n, _, rest = text.partition(":")
        at, _, replica_id = rest.partition(":")
        version = f"{n}:{at}"
        if counter(version) > counter(self.version) + 1:
            self._stale.set()  # a message was lost: read everything
            return
        await self._one(version, replica_id)


async def _none() -> list[ReplicaRecord]:
    return []


__all__ = ["PoolWatch", "counter"]
