"""Provenance records of rollouts run under grants, written after delivery, in batches.

:meth:`Recorder.add` queues a final record (no I/O); :meth:`Recorder.run` (a background loop on
a flag) writes what is queued every ``flush_s`` in one ``RECORDS`` script call
(:meth:`pool.store.grants.Grants.record`), at most ``batch`` records each. A write that fails
(Redis away) keeps the records queued and is retried next round; past ``max_pending`` the
oldest are dropped with an error log (the router never blocks a request on its records). A
written record is remembered for the failover guard (:meth:`router.bindings.Bindings.remember`),
which writes it again if a failover loses it.

What the client may see: the answer (with its ``rollout`` object) comes first, the record up to
``flush_s`` later; ``GET /v1/rollouts/{id}`` on this router flushes first
(:meth:`Recorder.flushed`), so it never misses a record this router holds. A router killed
between delivery and the flush loses those records (the answers were delivered; nothing ran
on another generation).

Concurrency: one event loop; :meth:`add` never awaits; one flush at a time (a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from pool.errors import StoreError
from pool.metrics import RouterMetrics
from pool.store import RedisStore
from pool.store.grants import FinalRecord
from router.bindings import Bindings, Ended
from router.provenance import RolloutInfo

log = logging.getLogger("router")


class Recorder:
    """See the module docstring."""

    def __init__(
        self,
        store: RedisStore,
        bindings: Bindings,
        metrics: RouterMetrics,
        *,
        flush_s: float,
        batch: int = 512,
        max_pending: int = 100_000,
    ) -> None:
        self.store = store
        self.bindings = bindings
        self.metrics = metrics
        self.flush_s = flush_s
        self.batch = batch
        self.max_pending = max_pending
        self._queue: deque[tuple[FinalRecord, RolloutInfo]] = deque()
        self._ids: set[str] = set()
        self._lock = asyncio.Lock()
        self._due = asyncio.Event()
        self.written = 0
        self.dropped = 0

    def add(self, record: FinalRecord, info: RolloutInfo) -> None:
        """Queue ``record`` (``info``: what the failover guard needs to write it again)."""
        if len(self._queue) >= self.max_pending:
            old, _ = self._queue.popleft()
            self._ids.discard(old.rollout_id)
            self.dropped += 1
            log.error(
                "record of rollout %s dropped: %d records wait for Redis",
                old.rollout_id,
                self.max_pending,
            )
        self._queue.append((record, info))
        self._ids.add(record.rollout_id)
        self.metrics.rollouts_ended.labels(record.state.value).inc()
        if len(self._queue) >= self.batch:
            self._due.set()

    def pending(self, rollout_id: str) -> bool:
        return rollout_id in self._ids

    async def flushed(self, rollout_id: str) -> None:
        """Return once ``rollout_id``'s record is written (at once if this router holds none).
        Raises :class:`StoreError` if Redis cannot take it now."""
        while rollout_id in self._ids:
            await self.flush()

    async def flush(self) -> int:
        """Write everything queued now; returns how many records were written."""
        async with self._lock:
            done = 0
            while self._queue:
                part = [self._queue[i] for i in range(min(self.batch, len(self._queue)))]
                await self.store.grants.record([r for r, _ in part])
                now = time.monotonic()
                for _ in part:
                    rec, info = self._queue.popleft()
                    self._ids.discard(rec.rollout_id)
                    self.bindings.remember(
                        rec.rollout_id,
                        Ended(
                            info,
                            False,
                            rec.state,
                            rec.reason,
                            rec.prompt_tokens,
                            rec.completion_tokens,
                            now,
                        ),
                    )
                done += len(part)
            self.written += done
            return done

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every ``flush_s`` (sooner when a batch is full) until ``stop``; then once more."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._due.wait(), self.flush_s)
            self._due.clear()
            try:
                await self.flush()
            except StoreError as e:
                log.warning("%d provenance record(s) wait: %s", len(self._queue), e.message)
        with contextlib.suppress(StoreError):
            await self.flush()


__all__ = ["Recorder"]
