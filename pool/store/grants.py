"""Capacity a router holds in advance (grants) and provenance records written after the fact.

A **grant** is a number of slots on one replica that one router holds, given by the ``GRANT``
script only while the replica is READY on an admissible generation (I1) and only out of free
capacity (bindings and every live router's slots count). The router admits one-request
rollouts against its slots with no Redis round trip. What keeps the contract:

* **I2**: a grant counts as active: ``TRANSITION`` refuses QUIESCED and UPDATING while any live
  router holds a slot on the replica, so weights cannot change under a grant. A grant is on
  the generation the replica served when it was given; it cannot serve another.
* **Returned at once when the replica leaves READY**: routers hear every change on the change
  feed (:mod:`pool.store.feed`), stop admitting on it, and return the grant (``GRANT`` with 0
  slots) once what runs under it has been delivered.
* **Reclaimed if the router dies**: a grant lives on its router's registration (the failover
  guard's heartbeat, ``failover_grace_s``); every script that counts grants drops those of
  routers whose registration expired. A router that cannot heartbeat for half that cuts what
  it runs and stops admitting (:mod:`router.failover`), so a reclaimed grant has nothing
  running under it.
* **Aborted** (a drain deadline, a taint): ``ABORT_GRANTS`` flags the replica; routers cut what
  runs under their grants on it and return them; the flag clears when the replica is READY.
* **Failover**: a grant a failover lost is found by the router's verification of the new epoch
  (:meth:`Grants.prove`), which cuts what runs under it before the updater may transfer.

**Records**: a rollout run under a grant has no binding while it runs; its final provenance
record is written after its answer was delivered, many per round trip (:meth:`Grants.record`),
with the per-generation admission and outcome counts.

Concurrency: any number of routers and tasks; each script is atomic. A cancelled call may or may
not have run: ``GRANT`` sets (not adds) a router's slots, and ``RECORDS`` never overwrites, so
both are safe to retry. Every call may raise :class:`~pool.errors.StoreUnavailable`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript

from pool.errors import AdmissionRefused, NotFound
from pool.store import grant_scripts
from pool.store._client import StoreClient
from pool.store.failover import Epoch, Failover
from pool.types import BindingState

RECORD_FIELDS = 11


@dataclass(frozen=True)
class Grant:
    """Slots one router holds on one replica, on the generation the replica served then."""

    replica_id: str
    slots: int
    generation: int
    label: str
    identity_digest: str


@dataclass(frozen=True)
class FinalRecord:
    """The provenance record of one rollout run under a grant (written by :meth:`Grants.record`)."""

    rollout_id: str
    replica_id: str
    generation: int
    label: str
    identity_digest: str
    state: BindingState
    reason: str
    prompt_tokens: int
    completion_tokens: int
    created_ms: int
    client: str = ""

    def fields(self) -> list[str]:
        return [
            self.rollout_id,
            self.replica_id,
            str(self.generation),
            self.label,
            self.identity_digest,
            self.state.value,
            self.reason,
            str(self.prompt_tokens),
            str(self.completion_tokens),
            str(self.created_ms),
            self.client,
        ]


class Grants:
    """The grant and record scripts of one store (see the module docstring)."""

    def __init__(self, store: StoreClient, failover: Failover) -> None:
        self.store = store
        self.failover = failover
        reg = store.r.register_script
        self._grant: AsyncScript = reg(grant_scripts.GRANT)
        self._abort: AsyncScript = reg(grant_scripts.ABORT_GRANTS)
        self._records: AsyncScript = reg(grant_scripts.RECORDS)

    def _grant_call(self, router_id: str, replica_id: str, slots: int, staleness: int) -> Any:
        k = self.store.k
        return (
            [k.replica(replica_id), k.active(replica_id), k.granted(replica_id), k.routers],
            [router_id, replica_id, slots, staleness],
            [k.latest, k.grant_generations(replica_id)],
        )

    async def grant(
        self, router_id: str, replica_id: str, slots: int, *, max_staleness: int
    ) -> Grant:
        """Hold ``slots`` on ``replica_id`` (fewer if that is all that is free, at least 1).
        Raises :class:`AdmissionRefused` (``not_ready``, ``stale_generation``,
        ``at_capacity``, ``unregistered``: the router's registration is not alive, ...)."""
        if slots < 1:
            raise ValueError("a grant holds at least one slot; use give_back")
        keys, args, more = self._grant_call(router_id, replica_id, slots, max_staleness)
        out = await self.store.run_script(self._grant, [*keys, *more], args)
        return _grant_of(replica_id, out)

    async def give_back(self, router_id: str, replica_id: str) -> None:
        """Return the router's grant on ``replica_id`` (idempotent)."""
        keys, args, more = self._grant_call(router_id, replica_id, 0, 0)
        await self.store.run_script(self._grant, [*keys, *more], args)

    async def abort(self, replica_id: str, reason: str) -> int:
        """Tell every router to cut what runs under its grant on ``replica_id`` and return it;
        returns the slots still granted (the caller waits for 0). :class:`NotFound` for an
        unknown replica."""
        k = self.store.k
        out = await self.store.run_script(
            self._abort,
            [k.replica(replica_id), k.version, k.granted(replica_id), k.routers],
            [replica_id, reason, k.changes],
        )
        if out[0] == "unknown":
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        return int(out[1])

    async def prove(
        self, epoch: Epoch, router_id: str, replica_ids: Iterable[str]
    ) -> dict[str, int] | None:
        """The router's slots on each of ``replica_ids`` (0: none) read at the primary of
        ``epoch`` (None: not settled, or the read reached another node; as
        :meth:`pool.store.Failover.prove`)."""
        if not epoch.settled:
            return None
        ids = list(replica_ids)
        check = self.store.settings.mode != "cluster"
        k = self.store.k

        async def run() -> list[Any]:
            async with self.store.r.pipeline(transaction=False) as p:
                if check:
                    p.info("server")
                for rid in ids:
                    p.hget(k.granted(rid), router_id)
                return list(await p.execute())

        res = await self.store.call(run)
        if check:
            if not self.failover.is_primary(epoch, res[0]):
                return None
            res = res[1:]
        return {rid: int(n or 0) for rid, n in zip(ids, res, strict=True)}

    async def record(self, records: Sequence[FinalRecord]) -> int:
        """Write final records (never over an existing one); returns how many were new."""
        if not records:
            return 0
        k = self.store.k
        args: list[str] = [
            str(max(1, int(self.store.settings.binding_retention_s * 1000))),
            self.store.journal_maxlen,
            str(RECORD_FIELDS),
        ]
        for r in records:
            args += r.fields()
        keys = [k.gen_admissions, k.gen_outcomes, k.journal]
        keys += [k.binding(r.rollout_id) for r in records]
        out = await self.store.call(lambda: self._records(keys=keys, args=args))
        return int(out)


def _grant_of(replica_id: str, out: list[str]) -> Grant:
    if out[0] != "ok":
        raise AdmissionRefused(out[1], replica=replica_id, detail=out[2] or None)
    return Grant(replica_id, int(out[1]), int(out[2]), out[3], out[4])


__all__ = ["FinalRecord", "Grant", "Grants"]
