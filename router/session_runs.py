"""One session's concurrent requests, limited across every worker and router
(``session_max_in_flight``).

Each request of a session holds a *mark* while it runs: a member of the sorted set
``{ns}:session:<rollout id>:runs`` (the pool's hash tag, so one Redis Cluster slot), scored by the
time its lease lapses (Redis clock, ms). :meth:`SessionRuns.hold` takes one atomically (the
``ENTER`` script drops lapsed marks, refuses when ``session_max_in_flight`` are held: 429
``session_busy``, else adds the request's own), renews it every third of its lease
(``request_lease_s``) while the request runs, and removes it when the request is settled
(:meth:`SessionRuns.settling`), which is **before** its answer, or a stream's last chunk, is
delivered: a client that sends its next turn as soon as it has the answer never finds its own
previous request still marked. A request that ends before it is settled (refused after its mark was
taken, e.g. an ended session) has its mark removed in the background. A worker or router that dies
mid-request leaves a mark nobody renews: it lapses within ``request_lease_s``, so a dead process
cannot wedge a session. The set expires with its last mark.

The mark is taken before the session's binding is read and its request counted, so a refused
request leaves the binding as it was. Redis unreachable when a mark is taken: 503
``store_unavailable`` (a session's request needs Redis anyway); when it is renewed or removed:
logged, and the mark lapses with its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pool.errors import StoreError
from pool.store import RedisStore
from router.bindings import Bindings, Outcome, Settled, Settlement, shielded
from router.errors import QuotaExceeded

log = logging.getLogger("router")

# ENTER — take (limit > 0) or renew (limit 0) a request's mark on a session.
# KEYS[1] the session's marks  ARGV[1] the request's token  ARGV[2] lease ms
# ARGV[3] marks the session may hold (0: renew the token's mark only if it is still held)
# Returns {'ok'} | {'busy', held} | {'lapsed'}
ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local limit = tonumber(ARGV[3])
if limit == 0 and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {'lapsed'} end
local held = redis.call('ZCARD', KEYS[1])
if limit > 0 and held >= limit then return {'busy', tostring(held)} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], tonumber(last[2]))
return {'ok'}
"""


@dataclass
class Mark:
    """One running request's mark on its session."""

    rollout_id: str
    token: str
    stop: asyncio.Event  # set: its renewal stops
    renewer: asyncio.Task[None]
    left: bool = False  # removed, or its removal under way


class SessionRuns:
    """The marks of this router's session requests (see the module docstring)."""

    def __init__(
        self,
        store: RedisStore,
        bindings: Bindings,
        *,
        limit: int,
        lease_s: float,
        retry_after_s: int,
    ) -> None:
        self.store = store
        self.bindings = bindings
        self.limit = limit
        self.lease_s = lease_s
        self.retry_after = str(retry_after_s)
        self._enter = store.r.register_script(ENTER)

    def key(self, rollout_id: str) -> str:
        """The sorted set of the marks of session ``rollout_id``."""
        return f"{self.store.k.p}:session:{rollout_id}:runs"

    async def _run(self, rollout_id: str, token: str, limit: int) -> list[str]:
        args = [token, max(1, int(self.lease_s * 1000)), limit]
        return await self.store.run_script(self._enter, [self.key(rollout_id)], args)

    @contextlib.asynccontextmanager
    async def hold(self, rollout_id: str) -> AsyncIterator[Mark | None]:
        """Hold a mark on session ``rollout_id`` for the block (or until :meth:`leave`); raise
        :class:`QuotaExceeded` (429 ``session_busy``) if it already has ``limit`` requests
        running. Yields the mark (None when ``limit`` is 0: nothing is counted)."""
        if not self.limit:
            yield None
            return
        token = secrets.token_hex(8)
        entering = asyncio.ensure_future(self._run(rollout_id, token, self.limit))
        try:
            out = await asyncio.shield(entering)
        except asyncio.CancelledError:  # the mark may still be taken: remove it once it is
            self.bindings.spawn(self._leave(rollout_id, token, entering))
            raise
        if out[0] == "busy":
            raise QuotaExceeded(
                f"session {rollout_id} already has {self.limit} request(s) in flight, its "
                f"limit (session_max_in_flight); send its requests one after another",
                code="session_busy",
                headers={"Retry-After": self.retry_after},
                limit=self.limit,
            )
        stop = asyncio.Event()
        mark = Mark(
            rollout_id, token, stop, self.bindings.spawn(self._renew(rollout_id, token, stop))
        )
        try:
            yield mark
        finally:
            if not mark.left:
                mark.left = True
                stop.set()
                self.bindings.spawn(self._leave(rollout_id, token, mark.renewer))

    async def leave(self, mark: Mark) -> None:
        """Remove ``mark`` now (once; a Redis failure is logged and the mark lapses)."""
        if mark.left:
            return
        mark.left = True
        mark.stop.set()
        await shielded(self._leave(mark.rollout_id, mark.token, mark.renewer))

    def settling(self, mark: Mark | None, settle: Settlement) -> Settlement:
        """``settle``, then :meth:`leave` ``mark``: the proxy settles a request before it
        delivers the answer, so the session is free again by the time the client has it."""
        if mark is None:
            return settle

        async def then_leave(o: Outcome) -> Settled:
            try:
                return await settle(o)
            finally:
                await self.leave(mark)

        return Settlement(then_leave)

    async def _renew(self, rollout_id: str, token: str, stop: asyncio.Event) -> None:
        """Renew the mark every third of its lease until ``stop`` is set (a flag, not a
        cancellation: see :mod:`router.bindings` on redis-py and cancellation)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.lease_s / 3)
                return
            try:
                out = await self._run(rollout_id, token, 0)
            except StoreError as e:
                log.warning("session %s: could not renew a request's mark: %s", rollout_id, e)
                continue
            if out[0] == "lapsed":
                log.warning("session %s: a running request's mark lapsed", rollout_id)
                return

    async def _leave(self, rollout_id: str, token: str, after: asyncio.Future[Any]) -> None:
        """Remove the mark once ``after`` (its renewal, or the call taking it) is done: a
        renewal after this would find it gone."""
        with contextlib.suppress(Exception):
            await after
        key = self.key(rollout_id)
        try:
            await self.store.call(lambda: self.store.r.zrem(key, token))
        except StoreError as e:
            log.warning("session %s: could not remove a request's mark: %s", rollout_id, e)


__all__ = ["ENTER", "Mark", "SessionRuns"]
