"""Owning admitted bindings until they end: release, lease renewal, background tasks.

Contracts:

* :meth:`Bindings.release` ends a binding exactly once (the store's RELEASE is idempotent). It
  runs in a tracked background task and the caller awaits it through ``asyncio.shield``: a
  cancelled caller (client disconnect, shutdown) does not cancel the release. It never raises;
  it says what it proved (:class:`Settled`). A release that *confirms* the binding was still
  active proves the replica's weights did not change while the request ran (I2: a replica
  cannot leave ``DRAINING`` for ``QUIESCED`` with an active binding), which is why the proxy
  releases before it delivers an answer. If Redis stays unreachable after a few retries the
  binding is left active and its lease runs out, after which any router's reaper aborts it.
* :meth:`Bindings.renewing` keeps a binding's lease alive while a request runs (a touch once a
  third of the lease has passed, by one background loop for all requests), so only the bindings
  of a *dead* router expire. Renewal stops when the request ends (a touch already in flight may
  still extend the lease once) or the binding has ended.
* A request whose binding ends under it is **cut** (:meth:`Bindings.cut`): a renewal that finds
  the binding gone (an updater abort, the reaper, a session close) or the failover guard
  (:mod:`router.failover`: a binding a Redis failover lost) cancels the request's task unless
  it has begun settling, and :func:`router.failover.cuttable` turns that into a 503 with the
  reason (an SSE error event on a stream); closing the upstream response makes vLLM abort the
  generation, so nothing keeps running on a binding nobody can prove.
* :meth:`Bindings.settlement` is the one place a binding's :class:`Settlement` is built: what a
  request ends with, a one-request rollout's RELEASE or a session request's touch.
* :meth:`Bindings.close` (app shutdown) waits for pending releases, then cancels what is left.

**Cancellation and redis-py.** A cancellation that arrives while redis-py (8.1, Python 3.11) is
in the middle of a command is sometimes swallowed: the store call returns normally inside a
task that was cancelled (reproduced: cancel ~1 ms into ``reap_expired``). So the router never
relies on cancelling a task that talks to Redis: background loops stop on a flag, and request
handlers await store calls through :func:`shielded`, which always raises ``CancelledError`` in a
cancelled caller (the store call itself runs to completion in the background).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from pool.errors import LimitReached, NotFound, StoreConflict, StoreError
from pool.metrics import RouterMetrics
from pool.store import RedisStore
from pool.types import BindingState
from router.provenance import RolloutInfo

log = logging.getLogger("router")
T = TypeVar("T")

RELEASE_RETRY_DELAYS_S = (0.05, 0.25, 1.0)
DEFAULT_REASON = "router error"
#: How long this router remembers a binding it ended, so that the failover guard can write its
#: record again if a failover lost the end (or the whole binding); longer than any replication
#: lag the primary tolerates (min-replicas-max-lag) plus the time to notice a failover.
RECENT_S = 60.0


@dataclass
class Outcome:
    """How one request ended for its binding; filled in as the request progresses.

    Starts as ``aborted``/"router error", so an unexpected exit never reads as finished.
    """

    state: BindingState = BindingState.ABORTED
    reason: str = DEFAULT_REASON
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: The replica gave a complete answer (finished, ended by vLLM's own abort, or violating
    #: its binding): its output
    #: is delivered only if the settlement confirms the binding.
    answered: bool = False

    def abort(self, reason: str) -> None:
        self.state, self.reason, self.answered = BindingState.ABORTED, reason, False

    def finish(self, tokens: tuple[int, int] | None, aborted: str | None = None) -> None:
        """A complete answer; ``aborted``: vLLM ended it itself (``finish_reason: "abort"``,
        or no token at all), so the binding ends ``aborted`` with that reason."""
        if aborted is None:
            self.state, self.reason = BindingState.FINISHED, ""
        else:
            self.state, self.reason = BindingState.ABORTED, aborted
        self.answered = True
        if tokens is not None:
            self.prompt_tokens, self.completion_tokens = tokens

    def violate(self, reason: str) -> None:
        self.state, self.reason, self.answered = BindingState.VIOLATED, reason, True


class Settled(StrEnum):
    """What ending a request proved about its binding."""

    CONFIRMED = "confirmed"  # still active when the request ended: the output is attributable
    ENDED_ELSEWHERE = "ended_elsewhere"  # ended under the request (updater abort, reaper, close)
    UNCONFIRMED = "unconfirmed"  # the store could not be reached


class Settlement:
    """ "What to do with the binding when the request ends"; runs at most once and remembers
    what it proved (later calls return the first verdict)."""

    def __init__(self, fn: Callable[[Outcome], Awaitable[Settled]]) -> None:
        self._fn = fn
        self.verdict: Settled | None = None

    @property
    def done(self) -> bool:
        return self.verdict is not None

    async def __call__(self, outcome: Outcome) -> Settled:
        if self.verdict is None:
            task = asyncio.current_task()
            if task is not None:
                _SETTLING.add(task)  # from here on, the request is not cut (see Bindings.cut)
            self.verdict = Settled.UNCONFIRMED  # if the call below is cancelled
            self.verdict = await self._fn(outcome)
        return self.verdict


def shielded(aw: Awaitable[T]) -> asyncio.Future[T]:
    """``await shielded(store.x(...))``: cancelling the awaiting task raises ``CancelledError``
    at once and reliably; the call completes in the background (its failure is discarded)."""
    inner = asyncio.ensure_future(aw)
    inner.add_done_callback(_consume)
    return asyncio.shield(inner)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True)
class Ended:
    """A binding this router ended (confirmed), kept :data:`RECENT_S` for the failover guard."""

    info: RolloutInfo
    session: bool
    state: BindingState
    reason: str
    prompt_tokens: int
    completion_tokens: int
    at: float  # monotonic


#: Request tasks that have begun settling their binding: never cut (their answer is decided).
_SETTLING: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


@dataclass
class Held:
    """One binding held by this router's running requests (see :meth:`Bindings.renewing`)."""

    lease_s: float
    renewed: float  # monotonic time of the admission or last renewal
    info: RolloutInfo | None = None
    session: bool = False
    epoch: int | None = None  # the failover epoch in which the binding was last proven
    cut: str | None = None  # why its requests were cut, once they were
    users: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


def cut_tasks(held: Held, reason: str) -> int:
    """Mark ``held`` cut (the first reason stays) and cancel its request tasks, except those
    that have begun settling. Returns how many were cancelled."""
    held.cut = held.cut or reason
    n = 0
    for task in list(held.tasks):
        if task not in _SETTLING and not task.done():
            task.cancel(f"binding cut: {reason}")
            n += 1
    return n


class Bindings:
    def __init__(self, store: RedisStore, metrics: RouterMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._tasks: set[asyncio.Task[Any]] = set()
        self._leases: dict[str, Held] = {}
        #: The failover epoch this router last verified its bindings in (None: not yet);
        #: maintained by :class:`router.failover.FailoverGuard`.
        self.epoch: int | None = None
        #: Bindings this router ended in the last RECENT_S seconds (oldest first).
        self.recent: dict[str, Ended] = {}

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in a task the router keeps a reference to until it finishes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def end(
        self,
        rollout_id: str,
        replica_id: str,
        state: BindingState,
        reason: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> Settled:
        """RELEASE, retried while Redis is unreachable. Never raises.

        ``CONFIRMED``: this call ended the binding, so it was active until now; ``ENDED_ELSEWHERE``:
        someone else (the updater, a reaper, a close) ended it first; ``UNCONFIRMED``: Redis
        stayed unreachable (the binding is left to its lease and the reaper). A binding whose
        request was cut (:meth:`cut`) ends aborted with the cut's reason.
        """
        held = self._leases.get(rollout_id)
        if held is not None and held.cut is not None and state is BindingState.ABORTED:
            state, reason = BindingState.ABORTED, held.cut
        for attempt, delay in enumerate((0.0, *RELEASE_RETRY_DELAYS_S)):
            if delay:
                await asyncio.sleep(delay)
            try:
                released = await self.store.release(
                    rollout_id,
                    replica_id,
                    state,
                    reason=reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                )
                if not released and attempt > 0:  # maybe our own earlier, unanswered attempt
                    b = await self.store.binding(rollout_id)
                    released = b.state is state and b.reason == reason
            except NotFound as e:
                log.error("release of %s failed: %s", rollout_id, e.message)
                await self._record_missing(rollout_id)
                return Settled.ENDED_ELSEWHERE
            except StoreConflict as e:
                log.error("release of %s failed: %s", rollout_id, e.message)
                return Settled.ENDED_ELSEWHERE
            except StoreError as e:
                log.warning(
                    "release of %s failed (attempt %d): %s", rollout_id, attempt + 1, e.message
                )
                continue
            if not released:
                return Settled.ENDED_ELSEWHERE
            self._remember(rollout_id, state, reason, prompt_tokens, completion_tokens)
            self.metrics.rollouts_ended.labels(state.value).inc()
            if state is not BindingState.FINISHED:
                log.info("rollout %s on %s %s: %s", rollout_id, replica_id, state, reason)
            return Settled.CONFIRMED
        log.error(
            "rollout %s left active: store unreachable; the reaper aborts it when its lease "
            "expires",
            rollout_id,
        )
        return Settled.UNCONFIRMED

    def _remember(
        self, rollout_id: str, state: BindingState, reason: str, prompt: int, completion: int
    ) -> None:
        held = self._leases.get(rollout_id)
        if held is not None and held.info is not None:
            self.remember(
                rollout_id,
                Ended(held.info, held.session, state, reason, prompt, completion, time.monotonic()),
            )

    async def _record_missing(self, rollout_id: str) -> None:
        """The binding of a request this router runs has no record at all: a failover lost it.
        Record it as aborted with that reason (best effort)."""
        held = self._leases.get(rollout_id)
        if held is None or held.info is None:
            return
        with contextlib.suppress(StoreError):
            await self.store.failover.record_lost(
                held.info,
                session=held.session,
                reason="its binding was lost in a Redis failover before the request ended",
            )

    async def release(
        self,
        rollout_id: str,
        replica_id: str,
        state: BindingState,
        reason: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> Settled:
        """:meth:`end` in a tracked task, awaited through ``shield`` (see the module doc)."""
        task = self.spawn(
            self.end(rollout_id, replica_id, state, reason, prompt_tokens, completion_tokens)
        )
        return await asyncio.shield(task)

    def settlement(
        self,
        rollout_id: str,
        replica_id: str,
        *,
        session_lease_s: float | None = None,
        then: Callable[[], None] | None = None,
    ) -> Settlement:
        """What ends a request on the binding of ``rollout_id`` (on ``replica_id``): the
        :class:`Settlement` the proxy runs once, on whatever exit path the request takes.

        * A one-request rollout (``session_lease_s`` None): RELEASE with the request's outcome
          (:meth:`release`); ``then`` runs after it, however it ended.
        * A request of a session (``session_lease_s``: the session's lease): a ``VIOLATED``
          outcome ends the session (RELEASE); a failed request leaves it open and proves nothing
          (nothing is delivered that would need confirming: ``CONFIRMED``); a finished one adds
          its tokens with a touch that renews the lease and proves the session was still active
          (``CONFIRMED``). A session the touch finds at a limit is ended aborted with the
          limit's reason, one already ended is ``ENDED_ELSEWHERE``: either way the output is
          withheld; a store that cannot be reached is ``UNCONFIRMED``.
        """
        if session_lease_s is None:
            return Settlement(lambda o: self._release_request(rollout_id, replica_id, o, then))
        lease_s = session_lease_s
        return Settlement(
            lambda o: self._settle_session_request(rollout_id, replica_id, o, lease_s)
        )

    async def _release_request(
        self, rollout_id: str, replica_id: str, o: Outcome, then: Callable[[], None] | None
    ) -> Settled:
        self.metrics.path_round_trips.labels("release").inc()
        try:
            return await self.release(
                rollout_id, replica_id, o.state, o.reason, o.prompt_tokens, o.completion_tokens
            )
        finally:
            if then is not None:
                then()

    async def _settle_session_request(
        self, rollout_id: str, replica_id: str, o: Outcome, lease_s: float
    ) -> Settled:
        if o.state is BindingState.VIOLATED:
            return await self.release(
                rollout_id, replica_id, o.state, o.reason, o.prompt_tokens, o.completion_tokens
            )
        if o.state is not BindingState.FINISHED:
            log.info(
                "session %s: request failed (%s); the session stays open", rollout_id, o.reason
            )
            return Settled.CONFIRMED
        try:
            await shielded(
                self.store.touch(
                    rollout_id,
                    prompt_tokens=o.prompt_tokens,
                    completion_tokens=o.completion_tokens,
                    lease_s=lease_s,
                )
            )
        except LimitReached as e:
            await self.release(rollout_id, replica_id, BindingState.ABORTED, e.reason)
            return Settled.ENDED_ELSEWHERE
        except NotFound:
            return Settled.ENDED_ELSEWHERE
        except StoreError as e:
            log.warning("session %s: could not confirm the binding: %s", rollout_id, e.message)
            return Settled.UNCONFIRMED
        return Settled.CONFIRMED

    @contextlib.contextmanager
    def renewing(
        self,
        rollout_id: str,
        lease_s: float,
        info: RolloutInfo | None = None,
        *,
        session: bool = False,
        epoch: int | None = None,
    ) -> Iterator[Held]:
        """Keep the binding's lease alive for the duration of the block; the block's task may
        be cut (:meth:`cut`). ``epoch``: the failover epoch in which the binding was admitted
        (default: the current one); ``info`` lets the failover guard record a lost binding.

        Costs a dict entry: one background loop (:meth:`renew_forever`) renews every binding in
        flight once a third of its lease has passed. Nested blocks for one rollout (concurrent
        requests of a session) share the entry until the last one ends.
        """
        entry = self._leases.get(rollout_id)
        if entry is None:
            entry = self._leases[rollout_id] = Held(
                lease_s, time.monotonic(), info, session, self.epoch if epoch is None else epoch
            )
        task = asyncio.current_task()
        entry.users += 1
        if task is not None:
            entry.tasks.add(task)
        try:
            yield entry
        finally:
            entry.users -= 1
            if task is not None:
                entry.tasks.discard(task)
            if entry.users == 0 and self._leases.get(rollout_id) is entry:
                del self._leases[rollout_id]

    def held(self) -> dict[str, Held]:
        """The bindings of the requests running now (a copy)."""
        return dict(self._leases)

    def cut(self, rollout_id: str, reason: str) -> int:
        """Cut the running requests of ``rollout_id`` (their binding ended or cannot be proven):
        cancel their tasks, except those that have begun settling. Returns how many were cut."""
        entry = self._leases.get(rollout_id)
        if entry is None:
            return 0
        n = cut_tasks(entry, reason)
        if n:
            log.warning("rollout %s: %d request(s) cut: %s", rollout_id, n, reason)
        return n

    def remember(self, rollout_id: str, ended: Ended) -> None:
        """Keep a rollout this router ended for :data:`RECENT_S` (a record written after the
        fact, :mod:`router.records`), so the failover guard can write it again if lost."""
        while self.recent:
            oldest = next(iter(self.recent))
            if ended.at - self.recent[oldest].at < RECENT_S:
                break
            del self.recent[oldest]
        self.recent[rollout_id] = ended

    async def renew_forever(self, tick_s: float, stop: asyncio.Event) -> None:
        """Renew due leases every ``tick_s`` until ``stop`` is set (a flag, not cancellation).

        All due leases go to Redis together, in a few pipelined round trips
        (:meth:`pool.store.RedisStore.renew`), not one call each: a thousand rollouts in flight
        cost a handful of round trips per tick and never a burst of concurrent calls.
        """
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick_s)
            now = time.monotonic()
            due = {rid: e for rid, e in self._leases.items() if now - e.renewed >= e.lease_s / 3}
            if not due:
                continue
            try:
                gone = await self.store.renew({rid: e.lease_s for rid, e in due.items()})
            except StoreError as e:
                log.warning("lease renewal of %d binding(s) failed: %s", len(due), e.message)
                continue
            for rid, entry in due.items():
                if rid in gone:  # ended under the request: stop generating for nobody
                    self.cut(rid, "the rollout's binding was ended while the request ran")
                else:
                    entry.renewed = now

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
