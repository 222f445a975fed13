"""The seam between the pool's store and redis-py: one client (standalone, Sentinel or Cluster),
its errors translated into the pool's, and three ways to run a Lua script (alone, sharing a round
trip with concurrent calls, or durable with ``WAIT``). :class:`pool.store.RedisStore` builds the
pool's operations on it; the failover epoch (:mod:`pool.store.failover`), the grants
(:mod:`pool.store.grants`) and the updater lease (:mod:`pool.store.lease`) build theirs on its
public part: :attr:`~StoreClient.r`, :attr:`~StoreClient.k`, :attr:`~StoreClient.settings`,
:attr:`~StoreClient.journal_maxlen`, :meth:`~StoreClient.call`, :meth:`~StoreClient.run_script`
and :meth:`~StoreClient.run_durable`.

Safe for concurrent tasks of one event loop; every call may raise
:class:`~pool.errors.StoreUnavailable` (Redis unreachable or refusing writes for now, e.g. in a
failover), :class:`~pool.errors.StoreBusy` (this process's connection pool stayed exhausted) or
:class:`~pool.errors.StoreError`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any, Self

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import LockError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pool.errors import (
    NotReplicated,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    raise_if_cancelling,
)
from pool.settings import StoreSettings
from pool.store import scripts
from pool.store.batch import ScriptBatcher
from pool.store.connect import Clients, connect
from pool.store.keys import Keys

_POOL_EXHAUSTED = "No connection available."
#: Error replies that mean "this primary cannot take writes right now" (failover in progress).
#: Matched as words anywhere in the message: pipelines wrap the reply, e.g. ``Command # 1
#: (...) of pipeline caused error: ('NOREPLICAS Not enough good replicas to write.',)``.
_TRANSIENT = re.compile(r"\b(NOREPLICAS|READONLY|LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b")


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, at least 1 (Redis expiry and WAIT arguments)."""
    return max(1, int(seconds * 1000))


class StoreClient:
    """One process's connection to the pool's Redis, with the pool's scripts registered.

    Construct with :meth:`connect`; close with :meth:`close`.
    """

    def __init__(
        self, client: Any, settings: StoreSettings, clients: Clients | None = None
    ) -> None:
        self.r = client
        self.settings = settings
        self.k = Keys(settings.namespace)
        self._clients = clients or Clients(client)
        reg = client.register_script
        self._admit: AsyncScript = reg(scripts.ADMIT)
        self._release: AsyncScript = reg(scripts.RELEASE)
        self._touch: AsyncScript = reg(scripts.TOUCH)
        self._transition: AsyncScript = reg(scripts.TRANSITION)
        self._taint: AsyncScript = reg(scripts.TAINT)
        self._declare: AsyncScript = reg(scripts.DECLARE)
        self._register: AsyncScript = reg(scripts.REGISTER)
        #: ``StoreSettings.journal_maxlen`` as the scripts take it (their ``MAXLEN ~`` argument).
        self.journal_maxlen = str(settings.journal_maxlen)
        #: Group commit of ADMIT and RELEASE (not on a Cluster: its pipelines route per node).
        self._batch = (
            None
            if isinstance(client, RedisCluster)
            else ScriptBatcher(client, self.call, self._translate)
        )

    @classmethod
    def connect(cls, settings: StoreSettings) -> Self:
        """A store on a bounded, blocking connection pool (``StoreSettings.max_connections``)
        to a standalone Redis, the primary a set of sentinels names, or a Cluster
        (:mod:`pool.store.connect`). No I/O until the first call."""
        clients = connect(settings)
        return cls(clients.data, settings, clients)

    async def close(self) -> None:
        await self._clients.aclose()

    async def call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one redis-py call, translating its errors into the pool's (the seam).

        A cancellation of the calling task that arrives during the call always ends it with
        ``CancelledError``. redis-py alone may lose it: on Python 3.11 its socket write goes
        through ``asyncio.wait_for``, which returns normally when the cancellation lands as the
        write completes (CPython gh-86296), and a read cut by one can surface as a lost
        connection. A loop that retries store errors would then run on, and whoever cancelled
        it (an updater's or a router's ``stop()``) would wait for it forever."""
        task = asyncio.current_task()
        before = 0 if task is None else task.cancelling()
        try:
            out = await fn()
        except LockError as e:  # the lease's own protocol errors; UpdaterLease translates them
            raise_if_cancelling(e, since=before)
            raise
        except (RedisError, OSError) as e:
            raise_if_cancelling(e, since=before)
            raise self._translate(e) from e
        raise_if_cancelling(None, since=before)
        return out

    def _translate(self, e: Exception) -> Exception:
        """The pool's error for a redis-py error (``e`` itself for anything else)."""
        if isinstance(e, RedisConnectionError | RedisTimeoutError | OSError):
            # redis-py's blocking pool says so when no connection freed up in time: Redis is
            # fine, this process is saturated (a unit test pins the message)
            if isinstance(e, RedisConnectionError) and str(e) == _POOL_EXHAUSTED:
                return StoreBusy(
                    f"all {self.settings.max_connections} Redis connections stayed busy for "
                    f"{self.settings.pool_timeout_s:g} s"
                )
            return StoreUnavailable(
                f"Redis at {self.settings.safe_url} is unreachable ({type(e).__name__})"
            )
        if isinstance(e, RedisError):
            transient = _TRANSIENT.search(str(e))
            if transient is not None:
                # a primary that has no replica in sync yet (min-replicas-to-write), a demoted
                # or loading one, a cluster mid-failover: like an outage, it passes by itself
                # (pipelines report it as "Command # n (...) of pipeline caused error: ...")
                return StoreUnavailable(
                    f"Redis at {self.settings.safe_url} refuses writes for now ({transient[1]})"
                )
            return StoreError(f"redis error: {e}")
        return e

    async def run_script(self, script: AsyncScript, keys: list[str], args: list[Any]) -> list[str]:
        """Run ``script`` (registered on :attr:`r`) with its arguments as strings, through
        :meth:`call`; its reply as strings."""
        out = await self.call(lambda: script(keys=keys, args=[str(a) for a in args]))
        return [str(x) for x in out]

    async def _batched(self, script: AsyncScript, keys: list[str], args: list[Any]) -> list[str]:
        """:meth:`run_script`, sharing round trips with concurrent calls (:mod:`pool.store.batch`;
        direct on a Cluster)."""
        if self._batch is None:
            return await self.run_script(script, keys, args)
        out = await self._batch.run(script, keys, [str(a) for a in args])
        return [str(x) for x in out]

    async def run_durable(self, script: AsyncScript, keys: list[str], args: list[Any]) -> list[str]:
        """:meth:`run_script`, followed on the same connection by ``WAIT wait_replicas`` when the
        store is configured to wait (``StoreSettings.wait_replicas``). Raises
        :class:`NotReplicated` if fewer replicas acknowledged in time: the write is on the
        primary, but a failover could still lose it."""
        n = self.settings.wait_replicas
        if not n:
            return await self.run_script(script, keys, args)
        timeout_ms = ms(self.settings.wait_timeout_s)

        async def run() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                await script(keys=keys, args=[str(a) for a in args], client=p)
                p.execute_command("WAIT", n, timeout_ms)
                return list(await p.execute())

        out, acked = await self.call(run)
        if int(acked) < n:
            raise NotReplicated(
                f"a state change reached {int(acked)} of {n} replicas within "
                f"{self.settings.wait_timeout_s:g} s",
                replicas=int(acked),
            )
        return [str(x) for x in out]

    async def confirm_replicated(self) -> None:
        """Return once ``wait_replicas`` replicas hold everything written to the primary so far
        (no-op when the store does not wait), else :class:`NotReplicated`. A write followed by
        ``WAIT`` on one connection: the replication stream is ordered, so its acknowledgement
        covers every earlier write, whichever connection made it. Use after a NotReplicated
        write whose effect was read back, before acting on it."""
        n = self.settings.wait_replicas
        if not n:
            return
        timeout_ms = ms(self.settings.wait_timeout_s)

        async def run() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                p.incr(self.k.barrier)
                p.execute_command("WAIT", n, timeout_ms)
                return list(await p.execute())

        _, acked = await self.call(run)
        if int(acked) < n:
            raise NotReplicated(
                f"the primary's writes reached {int(acked)} of {n} replicas within "
                f"{self.settings.wait_timeout_s:g} s",
                replicas=int(acked),
            )

    async def ping(self) -> bool:
        return bool(await self.call(self.r.ping))
