"""The one-updater-at-a-time lease (I8) with fencing tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from pool.errors import RolloutPoolError, StaleFencingToken, StoreConflict, StoreUnavailable
from pool.store._client import StoreClient
from pool.store.failover import Failover, describe_token, fencing_token

log = logging.getLogger(__name__)


class UpdaterLease:
    """The updater lease, built on redis-py's :class:`~redis.asyncio.lock.Lock`.

    The lock's value is a fencing token, ``epoch << 32 | n`` (:func:`pool.store.failover.
    fencing_token`): ``n`` is drawn from a counter (``INCR``) and the failover epoch is read
    after it, from a source a failover cannot roll back. So tokens grow with every acquisition,
    also across failovers that lost the counter's last increments and the lease key itself, and
    no two updaters ever hold equal tokens; every fenced script compares its token with the
    lock's current value, so a stale updater whose lease expired can no longer write.
    ``acquire`` blocks up to ``blocking_timeout_s`` (None: forever); cancelling it leaves no
    lease behind.

    Redis writes are fenced by the scripts; engine calls are not, so the holder also keeps a
    local deadline: :attr:`valid_until` is the monotonic time at which the lease may have lapsed
    (the moment the last successful acquire/extend was *sent*, plus the lease TTL), and
    :meth:`require` refuses once it has passed, so no mutating engine call starts on a lease that
    may already belong to someone else. :meth:`keep_alive` renews it.
    """

    def __init__(self, store: StoreClient, failover: Failover, owner: str) -> None:
        self.store = store
        self.failover = failover
        self.owner = owner
        self.ttl_s = store.settings.updater_lease_s
        self.token: int | None = None
        self.valid_until = 0.0
        self._lock = Lock(
            store.r,
            store.k.lease,
            timeout=self.ttl_s,
            sleep=0.1,
            thread_local=False,
        )

    async def draw(self) -> int:
        """A new fencing token. The epoch is read before and after the ``INCR``; if they differ
        (a failover in between: the increment may have gone to either primary) it draws again,
        so the token's epoch is that of the primary that counted ``n``."""
        while True:
            before = await self.failover.epoch()
            n = int(await self.store.call(lambda: self.store.r.incr(self.store.k.fence)))
            after = await self.failover.epoch()
            if after.number == before.number:
                return fencing_token(after.number, n)
            log.warning(
                "failover epoch moved %d -> %d while drawing a token", before.number, after.number
            )

    async def acquire(self, blocking_timeout_s: float | None = None) -> int:
        token = await self.draw()
        sent = time.monotonic()
        ok = await self.store.call(
            lambda: self._lock.acquire(
                blocking=True, blocking_timeout=blocking_timeout_s, token=str(token)
            )
        )
        if not ok:
            raise StoreConflict("updater lease is held by another updater", token=token)
        self.token = token
        # a blocking acquire may have waited: the lease's TTL runs from its last attempt
        self.valid_until = max(sent, time.monotonic() - 0.1) + self.ttl_s
        return token

    def require(self) -> int:
        """The fencing token, if the lease is held and cannot have lapsed; else
        :class:`StaleFencingToken`. Call it before every fenced write or mutating engine call."""
        if self.token is None:
            raise StaleFencingToken("updater lease not held")
        if time.monotonic() >= self.valid_until:
            raise StaleFencingToken(
                f"updater lease (token {describe_token(self.token)}) may have lapsed: not "
                f"renewed within "
                f"{self.ttl_s:g} s",
                token=self.token,
            )
        return self.token

    async def held(self, timeout_s: float | None = None) -> int | None:
        """The fencing token once :meth:`require` grants one, waiting up to ``timeout_s``
        (default: one TTL) for :meth:`keep_alive` to renew or re-acquire a lease that may have
        lapsed (Redis was away); None if it does not come back (lost, or still away)."""
        deadline = time.monotonic() + (self.ttl_s if timeout_s is None else timeout_s)
        while True:
            try:
                return self.require()
            except StaleFencingToken:
                if time.monotonic() >= deadline:
                    return None
            await asyncio.sleep(0.05)

    async def extend(self) -> None:
        sent = time.monotonic()
        try:
            await self.store.call(lambda: self._lock.reacquire())
        except LockError as e:
            self.token = None
            raise StaleFencingToken(f"updater lease lost: {e}") from e
        self.valid_until = sent + self.ttl_s

    async def release(self) -> None:
        """Give the lease up (idempotent; a failure to reach Redis leaves it to expire)."""
        if self.token is None:
            return
        with contextlib.suppress(LockError, RolloutPoolError):
            await self.store.call(self._lock.release)
        self.token = None
        self.valid_until = 0.0

    async def keep_alive(self, retry_s: float = 1.0) -> None:
        """Renew the lease every third of its TTL until cancelled.

        While Redis is unreachable, retry every ``retry_s`` (no fenced write can proceed
        meanwhile either; :meth:`require` refuses once the local deadline passes). If the lease
        expired and nobody took it, take it again (a new fencing token; a Redis that cannot
        answer yet, e.g. still loading after a restart, is waited out). Returns (instead of
        raising) once another updater holds it: the caller must stop acting.
        """
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            while True:
                try:
                    await self.extend()
                    break
                except StoreUnavailable:
                    await asyncio.sleep(retry_s)
                except StaleFencingToken:
                    try:
                        token = await self.acquire(blocking_timeout_s=0)
                    except StoreUnavailable:  # e.g. a restarted Redis still loading: retry
                        await asyncio.sleep(retry_s)
                        continue
                    except StoreConflict:
                        log.error("updater lease lost to another updater")
                        return
                    log.warning(
                        "updater lease had expired; re-acquired (token %s)", describe_token(token)
                    )
                    break
