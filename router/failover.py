"""What a router does about Redis failing over (docs: operations/failover.md).

Replication is asynchronous, so a failover can lose an ADMIT the old primary acknowledged: the
binding is gone while its request runs, the updater sees one binding fewer and could drain the
replica under it. The :class:`FailoverGuard` closes that hole; one runs per router, ticking
every ``min(1 s, failover_grace_s / 5)``:

1. read the failover epoch (:meth:`pool.store.Failover.epoch`);
2. every binding of a running request not yet proven in that epoch (a new epoch, or an
   admission that started in an older one) is read at the epoch's primary in one pipelined
   round trip (:meth:`pool.store.Failover.prove`: it counts only if the node that answered is
   the one the sentinels name, and not while a failover is under way); a binding that is not
   active there is **cut** (:meth:`Bindings.cut`: the request is cancelled, its upstream
   connection closed, so vLLM stops generating; the client gets 503 ``binding_lost`` with the
   reason, a stream an SSE error event), and one that has no record at all is recorded as
   aborted with the reason (:meth:`pool.store.Failover.record_lost`);
   In a new epoch the bindings this router *ended* lately (:data:`router.bindings.RECENT_S`)
   are read too: one the failover lost entirely gets its final record again, one whose end it
   lost is ended again (same state, reason and token counts), so the provenance records stay
   exact;
3. only then report the epoch as verified, with a heartbeat that expires after
   ``failover_grace_s`` (written with ``WAIT`` like the fenced writes, so a failover does not
   lose the router's registration). The updater starts no weight transfer until every live
   router has verified the current epoch (:mod:`updater.failover`).

A router that has not managed a heartbeat for ``failover_grace_s / 2`` (Redis or the
sentinels unreachable) cuts every running request itself: the updater stops waiting for it
once its heartbeat expires, and nothing may then keep running on a binding nobody can prove.
Until its first heartbeat the router admits nothing (:attr:`Bindings.epoch` is None).

With grants (:mod:`router.grants`), step 2 also reads this router's grants at the epoch's
primary: one a failover lost is dropped and what runs under it cut. The grants live on the
registration step 3 renews; the time each heartbeat was sent is what
:meth:`~router.grants.GrantBook.live` measures, and self-fencing forgets every grant. Each
heartbeat also returns the pool view's version, which the change feed checks itself against
(:meth:`pool.store.feed.PoolWatch.check`).

The guard stops on a flag, never by cancellation (see :mod:`router.bindings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from pool.errors import StoreError, StoreUnavailable
from pool.metrics import RouterMetrics
from pool.store import Epoch, RedisStore
from pool.store.feed import PoolWatch
from pool.web import dumps
from router.bindings import Bindings, Ended, Held
from router.errors import BindingEnded
from router.grants import GrantBook

log = logging.getLogger("router")

#: The prepared response of a streamed request (set by the proxy), for the cut's error event.
STREAM = web.RequestKey("stream", web.StreamResponse)


class FailoverGuard:
    """See the module docstring."""

    def __init__(
        self, store: RedisStore, bindings: Bindings, metrics: RouterMetrics | None = None
    ) -> None:
        self.store = store
        self.bindings = bindings
        self.metrics = metrics
        self.router_id = f"router-{uuid.uuid4().hex[:10]}"
        self.grace_s = store.settings.failover_grace_s
        self.tick_s = min(1.0, self.grace_s / 5)
        self.last_ok = time.monotonic()
        self.lost = 0  # bindings found lost (no record at the new primary)
        self.cut = 0  # requests cut because their binding was not active
        self.restored = 0  # ended bindings whose end or record a failover lost, written again
        self.watch: PoolWatch | None = None
        self.grants: GrantBook | None = None

    def attach(self, watch: PoolWatch, grants: GrantBook | None) -> None:
        """The pool view to tell the version each heartbeat returns (the change feed's safety
        net), and the grants that live on this router's registration (None: grants off)."""
        self.watch, self.grants = watch, grants

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until ``stop`` is set, then deregister (best effort)."""
        while not stop.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick_s)
        with contextlib.suppress(StoreError):
            await self.store.failover.heartbeat(self.router_id, None, self.grace_s)

    async def tick(self) -> None:
        """One round: prove, cut, heartbeat; self-fence when rounds keep failing. A round is
        bounded by a quarter of ``failover_grace_s``: a Redis that stops answering (a frozen
        primary: its sockets stay open) must not hold the round past the point where this
        router's registration expires before it has cut its own requests."""
        limit = self.grace_s / 4
        try:
            async with asyncio.timeout(limit):
                epoch = await self.store.failover.epoch()
                if not await self.verify(epoch):
                    raise StoreUnavailable(f"failover to epoch {epoch.number} still under way")
                sent = time.monotonic()
                beat = await self.store.failover.heartbeat(
                    self.router_id, epoch.number, self.grace_s
                )
        except (StoreError, TimeoutError) as e:
            silent = time.monotonic() - self.last_ok
            if silent >= self.grace_s / 2:
                self.fence(f"this router could not reach Redis for {silent:.1f} s")
            why = e.message if isinstance(e, StoreError) else f"no answer within {limit:g} s"
            log.warning("failover guard: %s", why)
            return
        if self.bindings.epoch != epoch.number:
            log.warning("failover epoch %s verified (primary %s)", epoch.number, epoch.primary)
        self.bindings.epoch = epoch.number
        self.last_ok = time.monotonic()
        if self.grants is not None:
            self.cut += self.grants.registered(epoch.number, sent)
        if self.watch is not None:
            self.watch.check(beat.version)

    async def verify(self, epoch: Epoch) -> bool:
        """Cut the running requests whose binding is not active at the epoch's primary, among
        those not yet proven in ``epoch``; mark the others proven. In a new epoch, also write
        again the records of bindings this router ended lately that the failover lost. False:
        nothing could be proven (the failover is still under way)."""
        unproven = {rid: h for rid, h in self.bindings.held().items() if h.epoch != epoch.number}
        ended = dict(self.bindings.recent) if self.bindings.epoch != epoch.number else {}
        missing = await self.store.failover.prove(epoch, [*unproven, *ended])
        if missing is None or not await self._verify_grants(epoch):
            return False
        for rid, held in unproven.items():
            state = missing.get(rid)
            if state is None:
                held.epoch = epoch.number
                continue
            reason = f"its binding was lost in a Redis failover (epoch {epoch.number})"
            if state:
                reason = f"its binding was {state} while the request ran"
            elif held.info is not None:
                await self._record_lost(held, reason)
            self.cut += self.bindings.cut(rid, reason)
        for rid, end in ended.items():
            if rid in missing and rid not in unproven:
                await self._restore(rid, end, missing[rid])
        return True

    async def _verify_grants(self, epoch: Epoch) -> bool:
        """Every grant not yet proven in ``epoch`` is read at its primary; one it does not hold
        (a failover lost it) is dropped and what runs under it cut. False: nothing proven."""
        book = self.grants
        if book is None:
            return True
        unproven = {rid: lg for rid, lg in book.grants.items() if lg.epoch != epoch.number}
        if not unproven:
            return True
        held = await self.store.grants.prove(epoch, self.router_id, unproven)
        if held is None:
            return False
        for rid, lg in unproven.items():
            if held[rid] > 0:
                lg.epoch = epoch.number
            elif book.grants.get(rid) is lg:
                why = f"its grant was lost in a Redis failover (epoch {epoch.number})"
                self.cut += book.drop(rid, why)
        return True

    async def _restore(self, rollout_id: str, end: Ended, state: str) -> None:
        """A binding this router ended, whose end (``state`` 'active') or whole record ('')
        the failover lost: end it again / write its final record."""
        i = end.info
        if state == "active":
            await self.store.release(
                rollout_id,
                i.replica_id,
                end.state,
                reason=end.reason,
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
            )
        elif state == "":
            await self.store.failover.record_lost(
                i,
                session=end.session,
                reason=end.reason,
                state=end.state,
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
            )
        else:
            return
        self.restored += 1

    async def _record_lost(self, held: Held, reason: str) -> None:
        info = held.info
        assert info is not None
        if await self.store.failover.record_lost(
            info,
            session=held.session,
            reason=reason,
        ):
            self.lost += 1

    def fence(self, why: str) -> None:
        """Cut every running request (its binding or grant cannot be proven any more)."""
        for rid in self.bindings.held():
            self.cut += self.bindings.cut(rid, f"{why}; its binding cannot be proven")
        if self.grants is not None:
            self.cut += self.grants.fence(f"{why}; its grant cannot be proven")


async def cuttable(
    request: web.Request, held: Held, run: Awaitable[web.StreamResponse]
) -> web.StreamResponse:
    """Await a request's handling; if :meth:`Bindings.cut` cancelled it, answer 503
    ``binding_lost`` with the reason instead (or, once a stream has started, end it with an SSE
    error event). Any other cancellation (a client disconnect) propagates."""
    try:
        return await run
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if held.cut is None or task is None or task.uncancel() > 0:
            raise
        info = held.info
        rollout: dict[str, Any] = info.as_json() if info is not None else {}
        stream = request[STREAM] if STREAM in request else None
        if stream is not None and stream.prepared:
            err = {"code": "binding_lost", "message": held.cut, "rollout": rollout}
            with contextlib.suppress(ConnectionResetError):
                await stream.write(b"data: " + dumps({"error": err}).encode() + b"\n\n")
                await stream.write_eof()
            return stream
        raise BindingEnded(
            f"request cut: {held.cut}; its output cannot be attributed to a generation",
            code="binding_lost",
            headers=info.headers() if info is not None else None,
            reason=held.cut,
            rollout=rollout or None,
        ) from None


__all__ = ["STREAM", "FailoverGuard", "cuttable"]
