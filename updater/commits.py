"""The store side of a cycle: every move of a replica's controller committed as the same fenced
CAS in the store, across Redis failovers (:class:`Commits`, the base of
:class:`updater.cycle.CycleRunner`).

Contracts:

* a move is made in the controller first (:func:`pool.lifecycle.advance` refuses what the
  transition table does not allow; nothing is written then) and counts only once the store holds
  it with this updater's fencing token, on the primary and, where the store waits for them, on
  ``wait_replicas`` replicas;
* while Redis is unreachable (a failover) a commit or a read waits for up to ``store_retry_s``,
  bounded anyway by the lease's local deadline; a commit whose outcome is unknown is settled by
  reading the record back;
* a fenced-out updater (:class:`~pool.errors.StaleFencingToken`) writes nothing: the replica is
  the lease holder's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from pool.errors import NotReplicated, StaleFencingToken, StoreConflict, StoreUnavailable
from pool.evidence import Event, FailureKind, StepFailed
from pool.lifecycle import advance
from pool.store import RedisStore, UpdaterLease
from pool.types import ReplicaRecord, ReplicaState
from updater.handle import ReplicaHandle

log = logging.getLogger(__name__)
S = ReplicaState
T = TypeVar("T")


class Commits:
    """Commits and reads of replica records for one updater (see the module contracts). Safe
    for concurrent tasks on different replicas."""

    def __init__(self, store: RedisStore, lease: UpdaterLease, store_retry_s: float) -> None:
        self.store = store
        self.lease = lease
        #: How long a commit or a read waits out Redis being unreachable (a failover) before
        #: the step fails; bounded anyway by the lease's local deadline.
        self.store_retry_s = store_retry_s

    async def commit(
        self, h: ReplicaHandle, event: Event, *, reason: str = "", publish: bool = True
    ) -> None:
        """Advance the controller, then commit the same move in the store (fenced CAS).

        Raises :class:`LifecycleError` (nothing written) if the controller refuses, and
        :class:`StoreConflict` if the store moved under us; a replica found TAINTED by someone
        else (a router's violation check, the health checker) is adopted as TAINTED. While
        Redis is unreachable (a failover) the commit is retried for up to ``store_retry_s``:
        the record read back afterwards tells a CAS that landed from one that did not. A CAS
        that landed on the primary but not on ``wait_replicas`` replicas
        (:class:`~pool.errors.NotReplicated`) counts only once the record, read back, is ours
        and the replicas are confirmed to hold it (:meth:`_settle`); until then nothing acts
        on it, and past ``store_retry_s`` NotReplicated is raised (the controller stays where
        it was: a failover may still erase the write). A move into READY publishes its
        generation if it is newer than the published one, unless ``publish`` is off (a LoRA
        update publishes once all its replicas moved: :mod:`updater.lora`).
        """
        before = h.lc
        after = advance(before, event)
        kw: dict[str, Any] = {"reason": reason or after.reason}
        if after.state is S.READY and after.generation is not None:
            kw.update(
                generation=after.generation,
                identity_digest=after.identity or "",
                publish=publish,
                process=after.process.encode() if after.process else None,
            )
        if after.state is S.DRAINING and after.target is not None:
            kw.update(target=after.target, target_identity=after.target_identity or "")
        deadline = time.monotonic() + self.store_retry_s
        while True:
            token = self.lease.require()
            try:
                try:
                    await self.store.transition(
                        h.replica_id, token, before.state, after.state, **kw
                    )
                    break
                except NotReplicated:
                    pass  # on the primary, maybe not beyond: settled below
                except StoreUnavailable:
                    # Redis failing over: the CAS may or may not have landed (or been lost)
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.2)
                if await self._settle(h, before.state, after.state, token, deadline):
                    break
            except StaleFencingToken:
                raise  # fenced out: this updater neither reads on nor writes (I8)
            except StoreConflict:
                rec = await self.store.replica(h.replica_id)
                if rec.state is S.TAINTED:
                    h.lc = replace(before, state=S.TAINTED, reason=rec.reason)
                raise
        h.lc = after

    async def _settle(
        self, h: ReplicaHandle, before: S, after: S, token: int, deadline: float
    ) -> bool:
        """After a transition whose outcome is unknown (Redis unreachable) or that may not be
        replicated: True once the record reads ``after`` with our token and the replicas are
        confirmed to hold it (the epoch unchanged across the read and the confirmation, so both
        concern one primary); False if the record is still or again at ``before`` (the CAS did
        not land, or a failover lost it: the caller tries it again). Raises StoreConflict if
        the record is anything else, and the last StoreUnavailable (NotReplicated included)
        once ``deadline`` passes."""
        while True:
            try:
                epoch = await self.store.failover.epoch()
                rec = await self.store.replica(h.replica_id)
                if rec.state is before:
                    return False
                if rec.state is not after or rec.fence != token:
                    raise StoreConflict(
                        f"replica {h.replica_id} is {rec.state}, expected {before} or {after}",
                        replica=h.replica_id,
                        state=rec.state,
                    )
                await self.store.confirm_replicated()
                if (await self.store.failover.epoch()).number == epoch.number:
                    return True
            except StoreUnavailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.2)

    async def read(self, h: ReplicaHandle) -> ReplicaRecord:
        """The replica's record, waiting out Redis being unreachable for up to
        ``store_retry_s`` (a failover)."""
        return await self.retrying(lambda: self.store.replica(h.replica_id))

    async def retrying(self, read: Callable[[], Awaitable[T]]) -> T:
        """``read()`` (a store read), called again while Redis is unreachable, for up to
        ``store_retry_s`` (a failover); the last StoreUnavailable after that."""
        deadline = time.monotonic() + self.store_retry_s
        while True:
            try:
                return await read()
            except StoreUnavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _taint(self, h: ReplicaHandle, step: str, exc: BaseException) -> None:
        """Move the replica to TAINTED (I4) after an ambiguous failure of ``step``. A commit
        the store refuses (the state moved, or the lease may have lapsed while Redis was away)
        falls back to a fenced taint from any state, once the lease is held again (up to one
        TTL); a fenced-out updater writes nothing: the replica is the lease holder's now, and
        only the controller's own view becomes TAINTED."""
        reason = f"{step}: {type(exc).__name__}: {exc}"
        log.warning("tainting %s: %s", h.replica_id, reason)
        if h.lc.state is S.TAINTED:
            return
        try:
            await self.commit(h, StepFailed(step, FailureKind.AMBIGUOUS, reason), reason=reason)
            return
        except StoreConflict:  # StaleFencingToken included: the lease may only have lapsed
            pass
        h.lc = replace(h.lc, state=S.TAINTED, reason=reason)
        token = await self.lease.held()  # the keeper re-acquires a lease that lapsed
        try:
            if token is None:
                raise StaleFencingToken("updater lease not held")
            await self.store.taint(h.replica_id, reason, source="updater", token=token)
        except StaleFencingToken:
            log.error("not tainting %s in the store: this updater was fenced out", h.replica_id)
