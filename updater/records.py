"""The updater's update records in the store: saved while the lease is held, and a record that
ended kept until the store surely holds its end.

A save can fail (Redis away in a failover) or land on a primary that a failover then loses (the
records are not written with ``WAIT``). A running update's next save catches up, but a record's
*last* save has no next one: lost, the store would show the update ``running`` (or ``queued``)
for good. :class:`Records` therefore keeps every record that ended (a final state) and, every
``watch_interval_s``, reads it back and saves it again until the store has held the final state
for ``settle_s`` (a failover after that cannot lose it: the replicas have had it that long).

Writes are fenced by the lease: a fenced-out updater (resumed after SIGSTOP) writes nothing, so
it cannot put its stale view over a record its successor ended. One event loop; :meth:`watch`
runs as one of the updater's tasks until cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pool.errors import NotFound, StaleFencingToken, StoreError
from pool.records import UpdateRecord, UpdateState
from pool.store import RedisStore, UpdaterLease

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class _Ended:
    record: UpdateRecord
    held_since: float | None = None  # monotonic: when the store was first seen holding its end


class Records:
    """See the module docstring. ``lost`` is set once the lease went to another updater."""

    def __init__(
        self,
        store: RedisStore,
        lease: UpdaterLease,
        lost: asyncio.Event,
        *,
        watch_interval_s: float = 1.0,
        settle_s: float = 30.0,
    ) -> None:
        self.store = store
        self.lease = lease
        self.lost = lost
        self.watch_interval_s = watch_interval_s
        self.settle_s = settle_s
        self._ended: dict[str, _Ended] = {}

    async def holding(self) -> bool:
        """True once the lease is held and cannot have lapsed (waiting up to one TTL for the
        keeper to re-acquire a lease that lapsed while Redis was away); False once it is lost."""
        if self.lost.is_set():
            return False
        return await self.lease.held() is not None

    async def save(self, rec: UpdateRecord) -> None:
        """Store ``rec`` if this updater may write; never raises (while Redis is away the live
        record in memory stays authoritative and a later save catches up). A record that
        ended is kept and re-saved by :meth:`watch` until the store surely holds its end."""
        if rec.state.final:
            self._ended.setdefault(rec.id, _Ended(rec)).record = rec
        if not await self.holding():
            log.warning("update %s: record not saved: this updater lost the lease", rec.id)
            return
        try:
            await self.store.save_update(rec)
        except StoreError as e:
            log.warning("update %s: record not saved: %s", rec.id, e.message)

    @property
    def unsettled(self) -> list[str]:
        """Ids of ended updates whose end the store is not yet known to hold for good."""
        return sorted(self._ended)

    async def watch(self) -> None:
        """Until cancelled: read every ended record back, save again what the store lost or
        never got, forget it once the store held its end for ``settle_s``."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            for update_id, ended in list(self._ended.items()):
                await self._settle(update_id, ended)

    async def _settle(self, update_id: str, ended: _Ended) -> None:
        try:
            stored: UpdateRecord | None = await self.store.update(update_id)
        except NotFound:
            stored = None
        except StoreError:
            return  # Redis away: the next round
        if stored is not None and stored.state is ended.record.state:
            if ended.held_since is None:
                ended.held_since = time.monotonic()
            elif time.monotonic() - ended.held_since >= self.settle_s:
                del self._ended[update_id]
            return
        ended.held_since = None
        log.warning(
            "update %s: the store has it %s, not %s (a save lost or failed): saving it again",
            update_id,
            "missing" if stored is None else stored.state.value,
            ended.record.state.value,
        )
        await self.save(ended.record)

    async def interrupt(self, unfinished: list[UpdateRecord], why: str) -> None:
        """Mark these updates FAILED (``why``) so none is left ``running``; only while this
        updater holds the lease now (a fenced-out one leaves them to the new holder, which ends
        what it finds unfinished when it starts). It does not wait for a lapsed lease: the
        updater is stopping, its keeper gone."""
        try:
            self.lease.require()
        except StaleFencingToken:
            return
        for rec in unfinished:
            rec.state, rec.error, rec.finished_ms = UpdateState.FAILED, why, now_ms()
            await self.save(rec)

    async def finish_interrupted(self) -> None:
        """At start, with the lease: records an earlier updater left queued or running (it
        crashed, or was fenced out mid-update) end FAILED, saying so."""
        try:
            records = await self.store.updates(self.store.settings.update_records_max)
        except StoreError as e:
            log.warning("update records not checked: %s", e.message)
            return
        for rec in records:
            if rec.state.final:
                continue
            rec.state, rec.finished_ms = UpdateState.FAILED, now_ms()
            rec.error = "interrupted: its updater stopped before the update ended"
            await self.save(rec)


__all__ = ["Records", "now_ms"]
