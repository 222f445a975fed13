"""The store's reads: replica records (with the slots routers hold on them), bindings, the
journal, the per-generation counts. :class:`StoreReads` is :class:`~pool.store.RedisStore`'s base;
every call may raise :class:`~pool.errors.StoreUnavailable` and has no effect on the store."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pool.errors import NotFound
from pool.store._client import StoreClient
from pool.types import Binding, BindingState, ReplicaRecord, ReplicaState


@dataclass(frozen=True)
class JournalEntry:
    id: str
    fields: dict[str, str]

    @property
    def type(self) -> str:
        return self.fields.get("type", "")


def _int_or_none(raw: str | None) -> int | None:
    return int(raw) if raw else None


class StoreReads(StoreClient):
    """Reads of the pool's state (no writes)."""

    async def replica(self, replica_id: str) -> ReplicaRecord:
        recs = await self._replicas([replica_id])
        if not recs:
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        return recs[0]

    async def replicas(self) -> list[ReplicaRecord]:
        ids: set[str] = await self.call(lambda: self.r.smembers(self.k.replicas))
        return await self._replicas(sorted(ids))

    async def replicas_of(self, replica_ids: Iterable[str]) -> list[ReplicaRecord]:
        """The records of those of ``replica_ids`` that exist, read together (as
        :meth:`replicas` reads every one)."""
        return await self._replicas(replica_ids)

    async def _replicas(self, ids: Iterable[str]) -> list[ReplicaRecord]:
        """The records of ``ids`` in one pipelined round trip (3 reads each, plus the live
        routers, whose grants alone count) after one read of the server clock."""
        ids = list(ids)
        secs, usecs = await self.call(self.r.time)

        async def run() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                p.zrange(self.k.routers, 0, -1, withscores=True)
                for rid in ids:
                    p.hgetall(self.k.replica(rid))
                    p.scard(self.k.active(rid))
                    p.hgetall(self.k.granted(rid))
                return list(await p.execute())

        res = await self.call(run)
        routers = res[0]
        now_ms = int(secs) * 1000 + int(usecs) // 1000
        live = {str(r) for r, exp in routers if exp > now_ms}
        out = []
        for i, rid in enumerate(ids):
            h, active, grants = res[1 + 3 * i], res[2 + 3 * i], res[3 + 3 * i]
            if not h:
                continue
            out.append(
                ReplicaRecord(
                    replica_id=rid,
                    url=h.get("url", ""),
                    state=ReplicaState(h["state"]),
                    generation=int(h["generation"]) if h.get("generation") else None,
                    label=h.get("label") or None,
                    identity_digest=h.get("identity") or None,
                    active=int(active),
                    capacity=int(h.get("capacity", 64)),
                    fence=int(h.get("fence", 0)),
                    reason=h.get("reason", ""),
                    updated_ms=int(h.get("updated_ms", 0)),
                    process=h.get("process") or None,
                    granted=sum(int(n) for r, n in grants.items() if r in live),
                    grants_aborted=h.get("grants_aborted", ""),
                )
            )
        return out

    async def binding(self, rollout_id: str) -> Binding:
        h: dict[str, str] = await self.call(lambda: self.r.hgetall(self.k.binding(rollout_id)))
        if not h:
            raise NotFound(f"unknown rollout {rollout_id}", rollout_id=rollout_id)
        return Binding(
            rollout_id=h["rollout_id"],
            replica_id=h["replica_id"],
            generation=int(h["generation"]),
            label=h["label"],
            identity_digest=h.get("identity_digest", ""),
            state=BindingState(h["state"]),
            session=h.get("session") == "1",
            created_ms=int(h["created_ms"]),
            finished_ms=int(h["finished_ms"]) if h.get("finished_ms") else None,
            lease_expires_ms=int(h["lease_expires_ms"]) if h.get("lease_expires_ms") else None,
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            completion_tokens=int(h.get("completion_tokens", 0)),
            requests=int(h.get("requests", 0)),
            reason=h.get("reason", ""),
            client=h.get("client", ""),
            deadline_ms=_int_or_none(h.get("deadline_ms")),
            idle_limit_ms=_int_or_none(h.get("idle_limit_ms")),
            last_request_ms=_int_or_none(h.get("last_request_ms")),
        )

    async def journal(
        self, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[JournalEntry]:
        rows = await self.call(lambda: self.r.xrange(self.k.journal, start, end, count=count))
        return [JournalEntry(str(i), {str(k): str(v) for k, v in f.items()}) for i, f in rows]

    async def memory(self) -> tuple[int, int]:
        """Redis's ``used_memory`` and ``maxmemory`` in bytes (0: no limit), for the
        ``rolloutpool_redis_*_bytes`` gauges and alerts."""
        info = await self.call(lambda: self.r.info("memory"))
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    async def generation_admissions(self) -> dict[int, int]:
        """Rollouts admitted per generation number (counted by the ADMIT script)."""
        raw = await self.call(lambda: self.r.hgetall(self.k.gen_admissions))
        return {int(g): int(n) for g, n in raw.items()}

    async def leased_rollouts(self) -> int:
        n: int = await self.call(lambda: self.r.zcard(self.k.leases))
        return n
