"""Choosing a replica and admitting a rollout to it.

The store's scripts are the only authority (I1): the router merely *orders* candidates and
tries ``store.admit`` on each until one accepts (sessions, and one-request rollouts with
``grants`` off), or takes a slot of a grant the ``GRANT`` script gave it (one-request rollouts,
:meth:`Admitter.admit_granted`, :mod:`router.grants`). Ordering uses the pool view the change
feed keeps current (:mod:`pool.store.feed`), snapshotted for ``replica_view_ttl_s``
(:class:`ReplicaView`):

1. candidates are replicas that are ``READY``, whose generation is within ``max_staleness`` of
   the published one, that meet the client's constraints, that serve the requested model, that
   have spare capacity, and that this router has not seen fail to connect several times in a
   row (:mod:`router.health`: a dead process the store still calls READY);
2. fewest active bindings first (the view's count for other routers' bindings, this router's
   own live count for its own in-flight requests, its admissions still awaiting the ADMIT
   script, and its session admissions the cached view may not include yet), ties broken by
   **rendezvous hashing** of a prefix key (the prompt's first 256 characters or 64 token ids),
   so equal prompts land on the same replica and reuse its prefix cache. Because a choice is
   counted the moment it is made, a burst of concurrent admissions spreads over the replicas
   instead of all reading the same counts and picking the same one.

If no candidate admits, :meth:`Admitter.admit` (and :meth:`~Admitter.admit_granted`: one loop,
:meth:`Admitter._retrying`) retries at the pool view's next change (a replica READY, a
publish: the change feed wakes every waiting admission) or after a back-off, until
``admission_wait_s`` is spent, then raises :class:`~router.errors.NoReplicaAvailable` (503 with
``Retry-After``). Constraints (:mod:`router.constraints`) that cannot be met by the published
generation raise :class:`~router.constraints.GenerationUnsatisfiable` (409) at once, judged on a
fresh read of the published generation (the cached view may predate a publish).
``StoreUnavailable`` propagates (503, fail closed). A session refused by its client's quota
(``Terms.quota``, counted by the ADMIT script) raises :class:`~router.errors.QuotaExceeded`
(429) at once.

Failover: nothing is admitted until the router's failover guard has verified an epoch
(:attr:`Bindings.epoch`; :mod:`router.failover`), and an admission whose ADMIT straddled a new
epoch is read back from the current primary before it is used (a failover may have lost it:
then it counts as refused, ``lost_in_failover``, and the next candidate is tried).

Cancellation: if the caller is cancelled while an ADMIT script is in flight, the script is
allowed to finish (``asyncio.shield``) and a binding it created is released in the background
as ``aborted`` (``client disconnected``), so a cancelled admission leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pool.errors import AdmissionRefused, NotFound, StoreUnavailable
from pool.metrics import RouterMetrics
from pool.store import Admission, RedisStore, Terms
from pool.store.feed import PoolWatch
from pool.types import BindingState, Generation, ReplicaRecord, ReplicaState
from router.bindings import Bindings
from router.constraints import Constraints, GenerationUnsatisfiable, check_satisfiable
from router.errors import NoReplicaAvailable, QuotaExceeded
from router.grants import GrantBook, LocalGrant
from router.health import PassiveHealth

AFFINITY_CHARS = 256
AFFINITY_TOKENS = 64

#: The refusals an admission counts (``rolloutpool_router_refusals``), by kind: the label of the
#: first kind the refusal is an instance of.
REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (GenerationUnsatisfiable, "generation_unsatisfiable"),
    (NoReplicaAvailable, "no_replica_available"),
    (StoreUnavailable, "store_unavailable"),
    (QuotaExceeded, "client_sessions"),
)


def affinity_key(body: Mapping[str, Any]) -> bytes:
    """A stable prefix key of a request: first chars of the prompt/messages or first tokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one decides
    if prompt is None and isinstance(body.get("token_ids"), list):
        prompt = body["token_ids"]
    if isinstance(prompt, str):
        return prompt[:AFFINITY_CHARS].encode()
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt[:AFFINITY_TOKENS]).encode()
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            text = content if isinstance(content, str) else str(content)
            parts.append(text)
            size += len(text)
            if size >= AFFINITY_CHARS:
                break
        return "\x1e".join(parts)[:AFFINITY_CHARS].encode()
    return b""


def rendezvous(key: bytes, replica_id: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(key + b"\x00" + replica_id.encode(), digest_size=8).digest(), "big"
    )


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool as read from the store at ``taken`` (monotonic seconds)."""

    replicas: tuple[ReplicaRecord, ...]
    latest: Generation | None
    taken: float
    own_at_read: Mapping[str, int]
    epoch: int = 0
    """The view's epoch when the read began: session admissions completed in a later epoch
    may be missing from ``replicas[*].active``."""

    def replica(self, replica_id: str) -> ReplicaRecord | None:
        for r in self.replicas:
            if r.replica_id == replica_id:
                return r
        return None


def _decrement(counts: Counter[str], key: str) -> None:
    """One less for ``key``; the key goes once it reaches zero (counters stay small)."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


class ReplicaView:
    """A cached read of the store's replicas and published generation, refreshed after ``ttl_s``,
    plus this router's own counts that the read cannot include yet.

    Concurrent callers share one refresh (single flight); a cancelled caller does not cancel it.
    The view is only used to *order* candidates and find URLs; admission itself is atomic in
    Redis, so a stale view costs at most a refused ADMIT and a retry.

    Own counts, per replica, all synchronous (no await between a choice and its count):

    - ``own``: this router's in-flight single requests (:meth:`started` / :meth:`finished`);
    - pending choices whose ADMIT is in flight (:meth:`reserve` / :meth:`unreserve`);
    - session admissions made since the cached read began (:meth:`session_admitted`), dropped
      once a read that began after them replaces the snapshot.
    """

    def __init__(self, store: RedisStore, ttl_s: float, watch: PoolWatch | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        #: the change feed's view (:mod:`pool.store.feed`); without one, every refresh reads
        self.watch = watch
        #: this router's evidence that a replica answers (:mod:`router.health`)
        self.health = PassiveHealth()
        self._snap: PoolSnapshot | None = None
        self._refresh: asyncio.Future[PoolSnapshot] | None = None
        self.own: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._sessions: list[tuple[int, str]] = []  # (epoch when admitted, replica id)
        self._epoch = 0
        self._change: asyncio.Future[None] | None = None  # resolved by the next invalidate

    async def get(self, *, fresh: bool = False) -> PoolSnapshot:
        snap = self._snap
        if not fresh and snap is not None and time.monotonic() - snap.taken < self.ttl_s:
            return snap
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._load(fresh))
            self._refresh.add_done_callback(self._refreshed)
        return await asyncio.shield(self._refresh)

    def _refreshed(self, fut: asyncio.Future[PoolSnapshot]) -> None:
        self._refresh = None
        if not fut.cancelled() and fut.exception() is None:
            snap = self._snap = fut.result()
            self._sessions = [(e, rid) for e, rid in self._sessions if e >= snap.epoch]

    async def _load(self, fresh: bool) -> PoolSnapshot:
        """The pool as the change feed has it (read in full first when ``fresh`` or before the
        feed's first read), or, with no feed, as read now."""
        own = dict(self.own)
        self._epoch += 1
        epoch = self._epoch
        w = self.watch
        if w is not None:
            if fresh or w.read_at is None:
                await w.full()
            recs = tuple(w.records[k] for k in sorted(w.records))
            return PoolSnapshot(recs, w.latest, time.monotonic(), own, epoch)
        replicas, latest = await asyncio.gather(self.store.replicas(), self.store.latest())
        latest_gen = latest[0] if latest else None
        return PoolSnapshot(tuple(replicas), latest_gen, time.monotonic(), own, epoch)

    def invalidate(self) -> None:
        """Drop the cached snapshot and wake every :meth:`wait_change` caller (the router's
        change feed calls this after every change it applied)."""
        self._snap = None
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    async def wait_change(self, timeout_s: float) -> bool:
        """Wait for the next :meth:`invalidate`, at most ``timeout_s``; True if it came. Any
        number of callers may wait at once; a caller cancelled or timed out leaves the others
        waiting."""
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: it can lose a cancellation
                await asyncio.shield(self._change)
        except TimeoutError:
            return False
        return True

    def load(self, snap: PoolSnapshot, r: ReplicaRecord) -> int:
        """Active bindings on ``r``: others' as of the snapshot plus this router's own counts."""
        rid = r.replica_id
        others = max(0, r.active - snap.own_at_read.get(rid, 0))
        unseen = sum(1 for e, x in self._sessions if x == rid and e >= snap.epoch)
        return others + self.own[rid] + self._pending[rid] + unseen

    def started(self, replica_id: str, slots: int = 1) -> None:
        """Count a request of this router's on ``replica_id``, as the ``slots`` it holds."""
        self.own[replica_id] += slots

    def finished(self, replica_id: str, slots: int = 1) -> None:
        self.own[replica_id] -= slots
        if self.own[replica_id] <= 0:
            del self.own[replica_id]

    def reserve(self, replica_id: str) -> None:
        """Count a choice whose ADMIT is in flight (call before awaiting it)."""
        self._pending[replica_id] += 1

    def unreserve(self, replica_id: str) -> None:
        _decrement(self._pending, replica_id)

    def session_admitted(self, replica_id: str) -> None:
        """Count a session binding until a read that began after its admission is cached."""
        self._sessions.append((self._epoch, replica_id))


def candidates(
    view: ReplicaView,
    snap: PoolSnapshot,
    constraints: Constraints,
    max_staleness: int,
    key: bytes,
    accept: Callable[[ReplicaRecord], bool] | None = None,
    slots: int = 1,
) -> list[ReplicaRecord]:
    """Eligible replicas (with room for ``slots`` more) in admission order (pure given the
    snapshot and live counts)."""
    if snap.latest is None:
        return []
    low = snap.latest.number - max_staleness
    eligible = [
        r
        for r in snap.replicas
        if r.state is ReplicaState.READY
        and r.generation is not None
        and r.generation >= low
        and constraints.allows(r.generation)
        and view.load(snap, r) + slots <= r.capacity
        and (accept is None or accept(r))
        and view.health.admits(r.url)
    ]
    if key:
        tie = {r.replica_id: rendezvous(key, r.replica_id) for r in eligible}
    else:
        tie = {r.replica_id: random.getrandbits(64) for r in eligible}
    return sorted(eligible, key=lambda r: (view.load(snap, r), -tie[r.replica_id]))


@dataclass(frozen=True)
class Admitted:
    admission: Admission
    replica: ReplicaRecord
    epoch: int | None = None  # the failover epoch the ADMIT was sent in
    grant: LocalGrant | None = None  # admitted against this router's grant (no binding)


#: One round of an admission (:meth:`Admitter._retrying`): given the candidates in admission
#: order, the refusals so far (to add to) and when the admission began, the admission or None.
Attempt = Callable[[list[ReplicaRecord], dict[str, str], float], Awaitable[Admitted | None]]


class Admitter:
    """Admits rollouts (see the module docstring for ordering, waiting and cancellation)."""

    def __init__(
        self,
        store: RedisStore,
        view: ReplicaView,
        bindings: Bindings,
        metrics: RouterMetrics,
        *,
        max_staleness: int,
        wait_s: float,
        retry_after_s: int,
        grants: GrantBook | None = None,
        backoff_s: tuple[float, float] = (0.01, 0.25),
    ) -> None:
        self.grants = grants
        #: (first, longest) wait between rounds of a waiting admission with no change seen
        self.backoff_s = backoff_s
        self.store = store
        self.view = view
        self.bindings = bindings
        self.metrics = metrics
        self.max_staleness = max_staleness
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s

    async def admit(
        self,
        rollout_id: str,
        constraints: Constraints,
        key: bytes,
        *,
        session: bool,
        lease_s: float,
        accept: Callable[[ReplicaRecord], bool] | None = None,
        terms: Terms | None = None,
    ) -> Admitted:
        """Bind ``rollout_id`` (on ``terms``) to the best replica that accepts it; blocks up to
        ``wait_s``."""
        bound_terms = terms or Terms()

        async def attempt(
            order: list[ReplicaRecord], refusals: dict[str, str], t0: float
        ) -> Admitted | None:
            """ADMIT on each candidate in order (none before the failover guard has verified an
            epoch); the first that binds wins."""
            for r in order if self.bindings.epoch is not None else []:
                self.view.reserve(r.replica_id)
                epoch = self.bindings.epoch
                try:
                    adm = await self._admit_one(
                        rollout_id, r.replica_id, constraints, session, lease_s, bound_terms
                    )
                    if self.bindings.epoch != epoch:
                        await self._still_bound(rollout_id, r.replica_id)
                except AdmissionRefused as e:
                    if e.reason == "client_quota":
                        raise self._over_quota(bound_terms) from e
                    refusals[r.replica_id] = e.reason
                    continue
                finally:
                    self.view.unreserve(r.replica_id)
                if session:
                    self.view.session_admitted(r.replica_id)
                self.metrics.admissions.labels(r.replica_id).inc()
                self.metrics.admission_latency.observe(time.monotonic() - t0)
                return Admitted(adm, r, epoch)
            return None

        return await self._retrying(constraints, key, accept, 1, attempt)

    async def admit_granted(
        self,
        rollout_id: str,
        constraints: Constraints,
        key: bytes,
        *,
        accept: Callable[[ReplicaRecord], bool] | None = None,
        slots: int = 1,
    ) -> Admitted:
        """Admit a one-request rollout that asks for ``slots`` sequences against this router's
        grants (:mod:`router.grants`): the best candidate with that many free slots, with no
        I/O; if none has them, grow a grant (one round trip) and try again, up to ``wait_s``
        like :meth:`admit`."""
        book = self.grants
        assert book is not None

        async def attempt(
            order: list[ReplicaRecord], refusals: dict[str, str], t0: float
        ) -> Admitted | None:
            """Take the slots from the first candidate's grant that has them; else grow the
            candidates' grants in order until one yields them (none while the book is not
            live)."""
            if not book.live():
                return None
            for r in order:
                lg = book.take(r.replica_id, r.generation or 0, slots)
                if lg is not None:
                    return self._granted(rollout_id, r, lg, t0)
            for r in order:
                self.metrics.path_round_trips.labels("grant").inc()
                try:
                    await book.grow(r.replica_id, slots)
                except AdmissionRefused as e:
                    refusals[r.replica_id] = e.reason
                    continue
                lg = book.take(r.replica_id, r.generation or 0, slots)
                if lg is not None:
                    return self._granted(rollout_id, r, lg, t0)
            return None

        return await self._retrying(constraints, key, accept, slots, attempt)

    async def _retrying(
        self,
        constraints: Constraints,
        key: bytes,
        accept: Callable[[ReplicaRecord], bool] | None,
        slots: int,
        attempt: Attempt,
    ) -> Admitted:
        """The admission loop of :meth:`admit` and :meth:`admit_granted`: each round reads the
        pool view (the cached one first, fresh ones after), checks the constraints can be met,
        and hands the candidates in admission order to ``attempt``, which returns the admission
        or None, noting each replica's refusal in the dict it is given (for the 503). A round
        that admitted nothing is tried again at the view's next change (:meth:`ReplicaView.
        wait_change`: a replica READY, a generation published) or after a doubling back-off
        (``backoff_s``: 10 ms to 250 ms by default), whichever comes first, until ``wait_s`` has
        passed since the call; a round after a back-off reads the pool afresh. A refusal raised
        from here is counted by its kind (:data:`REFUSALS`)."""
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        backoff, max_backoff = self.backoff_s
        refusals: dict[str, str] = {}
        fresh = False
        try:
            while True:
                snap = await self.view.get(fresh=fresh)
                await self._satisfiable(snap, constraints)
                order = candidates(
                    self.view, snap, constraints, self.max_staleness, key, accept, slots
                )
                admitted = await attempt(order, refusals, t0)
                if admitted is not None:
                    return admitted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._unavailable(snap, constraints, refusals)
                changed = await self.view.wait_change(min(backoff, remaining))
                backoff = min(backoff * 2, max_backoff)
                fresh = not changed  # a change comes from the feed, which has applied it
        except (GenerationUnsatisfiable, NoReplicaAvailable, StoreUnavailable, QuotaExceeded) as e:
            label = next(label for kind, label in REFUSALS if isinstance(e, kind))
            self.metrics.refusals.labels(label).inc()
            raise

    def _granted(self, rollout_id: str, r: ReplicaRecord, lg: LocalGrant, t0: float) -> Admitted:
        g = lg.grant
        now_ms = int(time.time() * 1000)
        adm = Admission(rollout_id, r.replica_id, g.generation, g.label, g.identity_digest, now_ms)
        self.metrics.admissions.labels(r.replica_id).inc()
        self.metrics.admission_latency.observe(time.monotonic() - t0)
        return Admitted(adm, r, self.bindings.epoch, lg)

    def _over_quota(self, terms: Terms) -> QuotaExceeded:
        return QuotaExceeded(
            f"client {terms.quota_key} has {terms.quota} open sessions, its limit "
            f"(client_max_sessions); close one or let one end first",
            code="client_sessions",
            headers={"Retry-After": str(self.retry_after_s)},
            limit=terms.quota,
        )

    async def _satisfiable(self, snap: PoolSnapshot, c: Constraints) -> None:
        """Raise :class:`GenerationUnsatisfiable` only if the *fresh* published generation
        cannot meet ``c``: a generation published after the cached read is no reason for a 409
        (a burst must not get 409 for a generation published a moment ago)."""
        try:
            check_satisfiable(snap.latest, c, self.max_staleness)
        except GenerationUnsatisfiable:
            latest = await self.store.latest()
            check_satisfiable(latest[0] if latest else None, c, self.max_staleness)

    async def _admit_one(
        self,
        rollout_id: str,
        replica_id: str,
        c: Constraints,
        session: bool,
        lease_s: float,
        terms: Terms,
    ) -> Admission:
        if not session:
            self.metrics.path_round_trips.labels("admit").inc()
        task = asyncio.ensure_future(
            self.store.admit(
                rollout_id,
                replica_id,
                max_staleness=self.max_staleness,
                min_generation=c.min_generation,
                generation=c.generation,
                session=session,
                lease_s=lease_s,
                terms=terms,
            )
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._undo)
            raise

    async def _still_bound(self, rollout_id: str, replica_id: str) -> None:
        """AdmissionRefused(``lost_in_failover``) unless the binding is active at the current
        primary (the epoch moved while its ADMIT was in flight)."""
        try:
            active = (await self.store.binding(rollout_id)).state is BindingState.ACTIVE
        except NotFound:
            active = False
        if not active:
            raise AdmissionRefused("lost_in_failover", replica=replica_id)

    def _undo(self, task: asyncio.Future[Admission]) -> None:
        """Release a binding whose admission finished after its caller was cancelled."""
        if task.cancelled() or task.exception() is not None:
            return
        adm = task.result()
        self.bindings.spawn(
            self.bindings.end(
                adm.rollout_id, adm.replica_id, BindingState.ABORTED, "client disconnected"
            )
        )

    def _unavailable(
        self, snap: PoolSnapshot, c: Constraints, refusals: Mapping[str, str]
    ) -> NoReplicaAvailable:
        states = {r.replica_id: str(r.state) for r in snap.replicas}
        if self.bindings.epoch is None or (self.grants is not None and not self.grants.live()):
            why = "this router has not verified the failover epoch yet (Redis unreachable?)"
        elif snap.latest is None:
            why = "no generation has been published yet"
        elif not snap.replicas:
            why = "no replica is registered"
        elif refusals:
            why = "every eligible replica refused: " + ", ".join(
                f"{rid}={reason}" for rid, reason in sorted(refusals.items())
            )
        else:
            why = "no replica is READY on an admissible generation with spare capacity"
        return NoReplicaAvailable(
            f"no replica available after {self.wait_s:g}s: {why}",
            headers={"Retry-After": str(self.retry_after_s)},
            reason=why,
            latest=snap.latest.number if snap.latest else None,
            max_staleness=self.max_staleness,
            min_generation=c.min_generation,
            generation=c.generation,
            replicas=states,
        )
