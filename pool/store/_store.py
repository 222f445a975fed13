"""The :class:`RedisStore`: the pool's shared state in Redis (see :mod:`pool.store` for the key
map and the concurrency and failure contracts)."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from pool.errors import (
    AdmissionRefused,
    LimitReached,
    NotFound,
    NotReplicated,
    StaleFencingToken,
    StoreConflict,
    StoreError,
)
from pool.records import UpdateRecord
from pool.settings import StoreSettings
from pool.store._client import ms
from pool.store._reads import StoreReads
from pool.store.adapters import Adapters
from pool.store.connect import Clients
from pool.store.failover import Failover, describe_token
from pool.store.grants import Grants
from pool.store.lease import UpdaterLease
from pool.store.terms import NO_TERMS, Terms, limit_reason
from pool.types import (
    BindingState,
    Generation,
    GenerationRecord,
    ReplicaState,
)


@dataclass(frozen=True)
class Admission:
    """A successful admission: the binding's essentials as written by the script."""

    rollout_id: str
    replica_id: str
    generation: int
    label: str
    identity_digest: str
    created_ms: int


class RedisStore(StoreReads):
    """The pool's shared state in Redis. One instance per process; safe for concurrent tasks.

    Construct with :meth:`connect`; close with :meth:`close`. See the module docstring for the
    failure contracts.
    """

    def __init__(
        self, client: Any, settings: StoreSettings, clients: Clients | None = None
    ) -> None:
        super().__init__(client, settings, clients)
        #: The failover epoch and the router registry (:mod:`pool.store.failover`).
        self.failover = Failover(self, self._clients.sentinel)
        #: Capacity routers hold in advance, batched records (:mod:`pool.store.grants`).
        self.grants = Grants(self, self.failover)
        #: Publishing and retiring LoRA generations (:mod:`pool.store.adapters`).
        self.adapters = Adapters(self)

    # ---------------------------------------------------------------- admission (routers)

    async def admit(
        self,
        rollout_id: str,
        replica_id: str,
        *,
        max_staleness: int = 0,
        min_generation: int | None = None,
        generation: int | None = None,
        session: bool = False,
        lease_s: float | None = None,
        terms: Terms = NO_TERMS,
    ) -> Admission:
        """Bind ``rollout_id`` to ``replica_id`` if I1 holds; raise :class:`AdmissionRefused`.

        Checks, atomically: the replica is READY, its generation is within ``max_staleness`` of
        the published one and meets the constraints, it has capacity, the rollout id is new and
        the client is within its session quota (``terms``; refused as ``client_quota`` only
        after the client's ended sessions were pruned and the admission tried once more).
        Writes the binding, the active set, the lease and a journal entry together. A
        session's admission is durable like a fenced write (``wait_replicas``): a session lives
        across many requests, and no router holds it between them, so a failover must not lose
        it (:class:`~pool.errors.NotReplicated` otherwise, and the binding the primary may hold
        is released at once, so retries during a replication stall do not fill the pool).
        """
        lease_ms = ms(lease_s if lease_s is not None else self.settings.binding_lease_s)
        keys = [
            self.k.replica(replica_id),
            self.k.active(replica_id),
            self.k.binding(rollout_id),
            self.k.leases,
            self.k.latest,
            self.k.journal,
            self.k.gen_admissions,
            self.k.client_sessions(terms.quota_key),
            self.k.granted(replica_id),
            self.k.routers,
        ]
        args = [
            rollout_id,
            replica_id,
            lease_ms,
            max_staleness,
            -1 if min_generation is None else min_generation,
            -1 if generation is None else generation,
            int(session),
            self.journal_maxlen,
            terms.owner,
            0 if terms.max_age_s is None else ms(terms.max_age_s),
            0 if terms.idle_s is None else ms(terms.idle_s),
            terms.quota,
        ]
        run = self.run_durable if session else self._batched
        try:
            out = await run(self._admit, keys, args)
            if out[0] == "refused" and out[1] == "client_quota":
                # tried again even if this prune removed nothing: another router's prune may
                # have emptied the set between the refusal and this read
                await self._prune(keys[7])
                out = await run(self._admit, keys, args)
        except NotReplicated:
            # the binding may hold a slot on the primary: end it now, not when its lease does
            with contextlib.suppress(StoreError):
                await self.release(
                    rollout_id, replica_id, BindingState.ABORTED, reason="admission not replicated"
                )
            raise
        if out[0] != "ok":
            raise AdmissionRefused(out[1], replica=replica_id, detail=out[2] or None)
        return Admission(rollout_id, replica_id, int(out[1]), out[2], out[3], int(out[4]))

    async def _prune(self, sessions_key: str) -> int:
        """Drop the ended sessions from a client's session set; returns how many."""
        ids: set[str] = await self.call(lambda: self.r.smembers(sessions_key))
        order = sorted(ids)

        async def states() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                for rid in order:
                    p.hget(self.k.binding(rid), "state")
                return list(await p.execute())

        ended = [
            rid for rid, st in zip(order, await self.call(states), strict=True) if st != "active"
        ]
        if ended:
            await self.call(lambda: self.r.srem(sessions_key, *ended))
        return len(ended)

    async def release(
        self,
        rollout_id: str,
        replica_id: str,
        state: BindingState = BindingState.FINISHED,
        *,
        reason: str = "",
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        only_if_expired: bool = False,
    ) -> bool:
        """End an active binding. Returns False if it had already ended (idempotent), or, with
        ``only_if_expired``, if its lease has not expired (checked in the same script, so a
        renewal that lands just before cannot be overridden).

        Raises :class:`NotFound` for an unknown rollout and :class:`StoreConflict` if the
        binding belongs to another replica.
        """
        if state is BindingState.ACTIVE:
            raise ValueError("release needs a final state")
        out = await self._batched(
            self._release,
            [
                self.k.binding(rollout_id),
                self.k.active(replica_id),
                self.k.leases,
                self.k.journal,
                self.k.gen_outcomes,
            ],
            [
                rollout_id,
                replica_id,
                state.value,
                reason,
                prompt_tokens,
                completion_tokens,
                ms(self.settings.binding_retention_s),
                self.journal_maxlen,
                int(only_if_expired),
            ],
        )
        if out[0] == "unknown":
            raise NotFound(f"unknown rollout {rollout_id}", rollout_id=rollout_id)
        if out[0] == "mismatch":
            raise StoreConflict(
                f"rollout {rollout_id} is bound to {out[1]}, not {replica_id}",
                rollout_id=rollout_id,
            )
        return out[0] == "ok"

    async def touch(
        self,
        rollout_id: str,
        *,
        requests: int = 0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        lease_s: float | None = None,
        activity: bool = True,
    ) -> int:
        """Extend an active binding's lease and add request/token counts. ``activity``: a
        request starts, runs or ends (resets the idle clock of :class:`Terms`); False for a
        heartbeat.

        Returns the new expiry (ms; never past the binding's max age or idle limit). Raises
        :class:`LimitReached` if the binding reached one of them (it is left for the caller or
        the reaper to end) and :class:`NotFound` if the binding is not active.
        """
        lease_ms = ms(lease_s if lease_s is not None else self.settings.binding_lease_s)
        out = await self.run_script(
            self._touch,
            [self.k.binding(rollout_id), self.k.leases],
            [rollout_id, lease_ms, requests, prompt_tokens, completion_tokens, int(activity)],
        )
        if out[0] == "limit":
            reason = limit_reason(out[1], int(out[2]))
            raise LimitReached(
                f"rollout {rollout_id}: {reason}",
                reason=reason,
                rollout_id=rollout_id,
                state="active",
            )
        if out[0] != "ok":
            raise NotFound(
                f"rollout {rollout_id} is not active ({out[1] or 'unknown'})",
                rollout_id=rollout_id,
                state=out[1] or None,
            )
        return int(out[1])

    async def renew(self, leases: dict[str, float], *, chunk: int = 256) -> set[str]:
        """Extend many bindings' leases (rollout id -> lease seconds) in pipelined chunks of
        ``chunk`` TOUCH scripts: one round trip per chunk however many rollouts are in flight.
        Each is a running request (it resets the idle clock). Returns the ids that are no longer
        active or reached a limit of their :class:`Terms` (nothing to renew). A StoreError
        leaves the remaining chunks unrenewed; renewing is idempotent, so the caller retries
        next tick."""
        gone: set[str] = set()
        items = list(leases.items())
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]

            async def run(part: list[tuple[str, float]] = part) -> list[Any]:
                async with self.r.pipeline(transaction=False) as p:
                    for rid, lease_s in part:
                        await self._touch(
                            keys=[self.k.binding(rid), self.k.leases],
                            args=[rid, ms(lease_s), 0, 0, 0, 1],
                            client=p,
                        )
                    return list(await p.execute())

            for (rid, _), out in zip(part, await self.call(run), strict=True):
                if str(out[0]) != "ok":
                    gone.add(rid)
        return gone

    async def reap_expired(self, limit: int = 100) -> list[str]:
        """Abort bindings whose lease expired (e.g. their router died). Returns their ids.

        Safe to run from many processes at once: each binding is released exactly once. The
        expiry is checked again inside the release script, so a binding whose lease a heartbeat
        renewed after the scan is left alone. The reason is "lease expired", or the limit of its
        :class:`Terms` it reached (its lease cannot have been renewed past that).
        """
        now_s, now_us = await self.call(self.r.time)
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        ids: list[str] = await self.call(
            lambda: self.r.zrangebyscore(self.k.leases, "-inf", now_ms, start=0, num=limit)
        )
        reaped: list[str] = []
        fields = ("replica_id", "created_ms", "deadline_ms", "idle_limit_ms", "last_request_ms")
        for rid in ids:
            key = self.k.binding(rid)
            replica, created, deadline, idle, last = await self.call(
                partial(self.r.hmget, key, fields)
            )
            if replica is None:
                await self.call(partial(self.r.zrem, self.k.leases, rid))
                continue
            reason = "lease expired"
            if deadline is not None and now_ms >= int(deadline):
                reason = limit_reason("max_age", int(deadline) - int(created))
            elif idle is not None and now_ms >= int(last) + int(idle):
                reason = limit_reason("idle", int(idle))
            if await self.release(
                rid,
                str(replica),
                BindingState.ABORTED,
                reason=reason,
                only_if_expired=True,
            ):
                reaped.append(rid)
        return reaped

    async def abort_active(self, replica_id: str, reason: str) -> list[str]:
        """Mark every active binding on a replica aborted (crash, drain timeout) and tell the
        routers to cut what runs under their grants on it (:meth:`Grants.abort`; they return
        the grants, which a drain waits for). Returns the binding ids."""
        with contextlib.suppress(NotFound):
            await self.grants.abort(replica_id, reason)
        ids: set[str] = await self.call(lambda: self.r.smembers(self.k.active(replica_id)))
        done = []
        for rid in sorted(ids):
            if await self.release(rid, replica_id, BindingState.ABORTED, reason=reason):
                done.append(rid)
        return done

    # ---------------------------------------------------------------- replicas (updater)

    async def register_replica(
        self, replica_id: str, url: str, token: int, capacity: int = 64
    ) -> ReplicaState:
        """Add ``replica_id`` (UNINITIALIZED) or update its url and capacity; returns its state
        after the call. A known replica registered at another url is TAINTED in the same step
        (unless UNINITIALIZED or RECOVERING): routers never admit to a server nobody validated.
        Fenced (:class:`StaleFencingToken`)."""
        out = await self.run_durable(
            self._register,
            [
                self.k.replicas,
                self.k.replica(replica_id),
                self.k.lease,
                self.k.journal,
                self.k.version,
            ],
            [replica_id, url, capacity, token, self.journal_maxlen, self.k.changes],
        )
        self._check_token(out, token)
        return ReplicaState(out[1])

    async def transition(
        self,
        replica_id: str,
        token: int,
        expected: ReplicaState,
        new: ReplicaState,
        *,
        reason: str = "",
        generation: Generation | None = None,
        identity_digest: str = "",
        publish: bool = False,
        target: Generation | None = None,
        target_identity: str = "",
        process: str | None = None,
    ) -> int:
        """Fenced compare-and-set ``expected`` → ``new``. Returns the replica's active count.

        Raises :class:`StaleFencingToken` if ``token`` no longer holds the updater lease,
        :class:`StoreConflict` if the state is not ``expected`` or if entering QUIESCED/UPDATING
        with active bindings (I2), :class:`NotFound` for an unknown replica. ``publish`` with
        ``new == READY`` publishes ``generation`` if it is newer than the published one.
        With ``wait_replicas`` it returns only once that many replicas hold the change (and
        everything written before it), else :class:`~pool.errors.NotReplicated`.
        """
        out = await self.run_durable(
            self._transition,
            [
                self.k.replica(replica_id),
                self.k.lease,
                self.k.active(replica_id),
                self.k.latest,
                self.k.journal,
                self.k.version,
                self.k.granted(replica_id),
                self.k.routers,
            ],
            [
                replica_id,
                token,
                expected.value,
                new.value,
                reason,
                "" if generation is None else generation.number,
                "" if generation is None else generation.label,
                identity_digest,
                int(publish),
                "" if target is None else target.number,
                "" if target is None else target.label,
                target_identity,
                self.journal_maxlen,
                process or "",
                self.k.changes,
            ],
        )
        self._check_token(out, token)
        if out[0] == "unknown":
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        if out[0] == "conflict":
            raise StoreConflict(
                f"replica {replica_id} is {out[1]}, expected {expected}",
                replica=replica_id,
                state=out[1],
            )
        if out[0] == "active":
            raise StoreConflict(
                f"replica {replica_id} has {out[1]} active bindings; cannot enter {new}",
                replica=replica_id,
                active=int(out[1]),
            )
        return int(out[1])

    async def taint(
        self,
        replica_id: str,
        reason: str,
        *,
        source: str,
        expected: ReplicaState | None = None,
        token: int | None = None,
    ) -> ReplicaState:
        """Move a replica to TAINTED from any state (or only from ``expected``). Returns the
        previous state.

        Closing admissions needs no lease (routers and operators taint without one); the
        updater passes its ``token``, and a token that no longer holds the lease is refused
        (:class:`StaleFencingToken`): a fenced-out updater writes nothing.
        """
        out = await self.run_durable(
            self._taint,
            [self.k.replica(replica_id), self.k.journal, self.k.lease, self.k.version],
            [
                replica_id,
                reason,
                source,
                self.journal_maxlen,
                "" if expected is None else expected.value,
                "" if token is None else token,
                self.k.changes,
            ],
        )
        if token is not None:
            self._check_token(out, token)
        if out[0] == "unknown":
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        if out[0] == "conflict":
            raise StoreConflict(f"replica {replica_id} is {out[1]}", replica=replica_id)
        return ReplicaState(out[1])

    # ---------------------------------------------------------------- generations

    async def declare_generation(self, record: GenerationRecord, token: int) -> bool:
        """Record a generation before rolling it out (only the newest
        ``generation_records_max`` are kept). Returns False if already declared identically;
        raises :class:`StoreConflict` for a different record, a number that is not
        newer than the published generation, or a label another generation already has."""
        gen = record.generation
        out = await self.run_durable(
            self._declare,
            [self.k.generations, self.k.lease, self.k.latest, self.k.journal, self.k.labels],
            [
                gen.number,
                record.model_dump_json(),
                token,
                self.journal_maxlen,
                gen.label,
                self.settings.generation_records_max,
            ],
        )
        self._check_token(out, token)
        if out[0] == "label_taken":
            raise StoreConflict(
                f"label {gen.label!r} already names generation {out[1]}",
                label=gen.label,
                generation=int(out[1]),
            )
        if out[0] == "conflict":
            raise StoreConflict(
                f"generation {record.generation.number} already declared differently",
                existing=out[1],
            )
        if out[0] == "not_newer":
            raise StoreConflict(
                f"generation {record.generation.number} is not newer than published g{out[1]}",
                latest=int(out[1]),
            )
        return out[0] == "ok"

    async def label_owner(self, label: str) -> int | None:
        """The declared generation named ``label``, if any."""
        raw = await self.call(lambda: self.r.hget(self.k.labels, label))
        return None if raw is None else int(raw)

    async def generation_record(self, number: int) -> GenerationRecord:
        raw = await self.call(lambda: self.r.hget(self.k.generations, str(number)))
        if raw is None:
            raise NotFound(f"generation {number} was never declared", generation=number)
        return GenerationRecord.model_validate_json(raw)

    async def newest_declared(self) -> int | None:
        """The highest declared generation number (None before the first); reads the numbers
        only, of at most ``generation_records_max`` records."""
        numbers: list[str] = await self.call(lambda: self.r.hkeys(self.k.generations))
        return max((int(n) for n in numbers), default=None)

    async def generation_records(self) -> list[GenerationRecord]:
        raw: dict[str, str] = await self.call(lambda: self.r.hgetall(self.k.generations))
        recs = [GenerationRecord.model_validate_json(v) for v in raw.values()]
        return sorted(recs, key=lambda r: r.generation.number)

    async def latest(self) -> tuple[Generation, str] | None:
        """The published generation and its identity digest, or None before the first."""
        h: dict[str, str] = await self.call(lambda: self.r.hgetall(self.k.latest))
        if not h:
            return None
        return Generation(number=int(h["number"]), label=h["label"]), h.get("identity", "")

    # ---------------------------------------------------------------- update records

    async def save_update(self, record: UpdateRecord) -> None:
        """Write (or overwrite) an update record and drop the oldest beyond
        ``update_records_max``. Records are the updater's, not routers'."""
        keep = self.settings.update_records_max

        async def run() -> None:
            async with self.r.pipeline(transaction=True) as p:
                p.hset(self.k.updates, record.id, record.model_dump_json())
                p.zadd(self.k.updates_order, {record.id: record.created_ms})
                p.zrange(self.k.updates_order, 0, -keep - 1)
                p.zremrangebyrank(self.k.updates_order, 0, -keep - 1)
                old = (await p.execute())[2]
            if old:
                await self.r.hdel(self.k.updates, *old)

        await self.call(run)

    async def update(self, update_id: str) -> UpdateRecord:
        raw = await self.call(lambda: self.r.hget(self.k.updates, update_id))
        if raw is None:
            raise NotFound(f"unknown update {update_id}", update_id=update_id)
        return UpdateRecord.model_validate_json(raw)

    async def updates(self, limit: int = 100) -> list[UpdateRecord]:
        """The newest ``limit`` update records, newest first."""
        ids = await self.call(lambda: self.r.zrevrange(self.k.updates_order, 0, limit - 1))
        if not ids:
            return []
        raw = await self.call(lambda: self.r.hmget(self.k.updates, ids))
        return [UpdateRecord.model_validate_json(x) for x in raw if x is not None]

    # ---------------------------------------------------------------- lease (I8)

    def updater_lease(self, owner: str | None = None) -> UpdaterLease:
        return UpdaterLease(self, self.failover, owner or uuid.uuid4().hex)

    @staticmethod
    def _check_token(out: list[str], token: int) -> None:
        if out[0] == "stale_token":
            holder = describe_token(int(out[1])) if out[1].isdigit() else out[1] or "none"
            raise StaleFencingToken(
                f"fencing token {describe_token(token)} does not hold the updater lease "
                f"(holder: {holder})",
                token=token,
            )
