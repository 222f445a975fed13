"""The failover epoch and what routers and the updater do with it (docs:
operations/failover.md).

Replication is asynchronous: a failover (or a crash of a lone Redis) can lose writes the old
primary already acknowledged. The old primary must also stop accepting writes before another
node is promoted: run every node with ``min-replicas-to-write 1`` and a
``min-replicas-max-lag`` shorter than the sentinels' ``down-after-milliseconds``
(``deploy/`` does), so a primary cut off from its replicas refuses writes before it is
replaced and one that comes back refuses them until it is a replica.

The **epoch** is a number that grows with every change of primary and is never lost with
them, because it does not live in the replicated data alone:

* Sentinel: the ``config-epoch`` the sentinels agree on for the service (``SENTINEL MASTER``,
  the highest any reachable sentinel reports; a sentinel that hands out the new primary's
  address already knows its epoch);
* standalone and Cluster: the primary (the node serving the pool's slot) is identified by its
  run id and replication id, both new after a restart or a promotion, and the ``EPOCH`` script
  gives a new identity the highest recorded epoch + 1.

What rests on it:

* **Fencing tokens** are ``epoch << 32 | n`` with ``n`` drawn from the ``INCR`` counter
  (:func:`fencing_token`): a token drawn after a failover is greater than every token drawn
  before it even if the counter's last increments were lost, and two updaters never hold equal
  tokens. The scripts still compare the lease value by equality.
* **Routers** read the epoch every tick; in a new epoch they check every in-flight binding at
  the new primary (:meth:`Failover.prove`, one pipelined read that also names the node it ran
  on, so it counts only if that node is the epoch's primary), cut the requests whose binding
  is gone (a lost binding is recorded as aborted with the reason, :meth:`Failover.record_lost`)
  and then report the epoch as verified (:meth:`Failover.heartbeat`, with a TTL of
  ``failover_grace_s``).
* The **updater** starts no weight transfer in an epoch until every live router has verified it,
  or ``failover_grace_s`` has passed since it first saw the epoch (a router that cannot reach
  Redis that long cuts its in-flight requests itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio.sentinel import Sentinel
from redis.commands.core import AsyncScript

from pool.errors import StoreUnavailable
from pool.store import scripts
from pool.store._client import StoreClient
from pool.types import BindingState

EPOCH_SHIFT = 32
_COUNTER = (1 << EPOCH_SHIFT) - 1


class BoundRollout(Protocol):
    """What :meth:`Failover.record_lost` needs of a binding (e.g. the router's ``RolloutInfo``)."""

    @property
    def rollout_id(self) -> str: ...
    @property
    def replica_id(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def label(self) -> str: ...
    @property
    def identity_digest(self) -> str: ...


def fencing_token(epoch: int, n: int) -> int:
    """The fencing token drawn as the ``n``-th increment of the counter in ``epoch``."""
    if not 0 < n <= _COUNTER:
        raise ValueError(f"fencing counter {n} out of range")
    return (epoch << EPOCH_SHIFT) | n


def token_epoch(token: int) -> int:
    return token >> EPOCH_SHIFT


def describe_token(token: int) -> str:
    """``e<epoch>.<n>``: how logs and errors show a token."""
    return f"e{token >> EPOCH_SHIFT}.{token & _COUNTER}"


@dataclass(frozen=True)
class Epoch:
    """The failover epoch, the primary it belongs to (``host:port`` or an identity) and that
    primary's run id ('': the sentinels have not learned it yet). ``settled`` is False while the
    sentinels are failing over (the answer with the highest epoch is down, disconnected or has
    a failover in progress): nothing may be proven in such an epoch."""

    number: int
    primary: str = field(compare=False)
    run_id: str = field(default="", compare=False)
    settled: bool = field(default=True, compare=False)


@dataclass(frozen=True)
class Heartbeat:
    """What a router's heartbeat returns: the live routers' verified epochs and the view's
    version (``''`` before the first change)."""

    routers: dict[str, int]
    version: str


class Failover:
    """Epoch reads and the router registry of one store. Safe for concurrent tasks."""

    def __init__(self, store: StoreClient, sentinel: Sentinel | None) -> None:
        self.store = store
        self.sentinel = sentinel
        reg = store.r.register_script
        self._epoch: AsyncScript = reg(scripts.EPOCH)
        self._router: AsyncScript = reg(scripts.ROUTER)
        self._lost: AsyncScript = reg(scripts.LOST)

    async def epoch(self) -> Epoch:
        """The current failover epoch. Raises :class:`StoreUnavailable` if no source answers."""
        if self.sentinel is not None:
            return await self._sentinel_epoch(self.sentinel)
        ident = await self.store.call(self._primary_identity)
        k = self.store.k
        n = await self.store.call(
            lambda: self._epoch(keys=[k.epochs, k.journal], args=[ident, self.store.journal_maxlen])
        )
        return Epoch(int(n), ident, ident.partition(":")[0])

    async def _sentinel_epoch(self, sentinel: Sentinel) -> Epoch:
        service = self.store.settings.sentinel_service
        answers = await asyncio.gather(
            *(s.sentinel_master(service) for s in sentinel.sentinels), return_exceptions=True
        )
        best: Epoch | None = None
        for a in answers:
            if isinstance(a, dict) and "config-epoch" in a:
                # "master" alone: no failover under way, not down, the link up
                settled = set(str(a.get("flags", "")).split(",")) == {"master"}
                e = Epoch(
                    int(a["config-epoch"]),
                    f"{a.get('ip')}:{a.get('port')}",
                    str(a.get("runid") or ""),
                    settled,
                )
                # the highest epoch wins; among equal ones, an unsettled answer
                if best is None or (e.number, not e.settled) > (best.number, not best.settled):
                    best = e
        if best is None:
            errors = {type(a).__name__ for a in answers if isinstance(a, BaseException)}
            raise StoreUnavailable(
                f"no sentinel of {self.store.settings.safe_url} answered "
                f"({', '.join(sorted(errors)) or 'unknown service'})"
            )
        return best

    async def _primary_identity(self) -> str:
        r = self.store.r
        kw: dict[str, Any] = {}
        if self.store.settings.mode == "cluster":
            await r.initialize()  # learns the slot map once (a no-op afterwards)
            kw["target_nodes"] = r.get_node_from_key(self.store.k.latest)
        server, repl = await asyncio.gather(r.info("server", **kw), r.info("replication", **kw))
        return f"{server['run_id']}:{repl['master_replid']}"

    async def prove(self, epoch: Epoch, rollout_ids: Iterable[str]) -> dict[str, str] | None:
        """The ids among ``rollout_ids`` whose binding is not active, with its state (``''``:
        no record at all), read *at the primary of* ``epoch``: every read goes with the node's
        run id on one connection, and None means the epoch is not settled or a read reached
        another node (a failover under way): nothing is proven, try again. Until the sentinels
        know the new primary's run id, its port stands in for it. (In Cluster mode the node is
        not checked.)"""
        if not epoch.settled:
            return None
        ids = list(rollout_ids) or [""]
        out: dict[str, str] = {}
        check = self.store.settings.mode != "cluster"
        for start in range(0, len(ids), 512):
            part = ids[start : start + 512]

            async def run(part: list[str] = part) -> list[Any]:
                async with self.store.r.pipeline(transaction=False) as p:
                    if check:
                        p.info("server")
                    for rid in part:
                        p.hget(self.store.k.binding(rid), "state")
                    return list(await p.execute())

            res = await self.store.call(run)
            if check:
                if not self.is_primary(epoch, res[0]):
                    return None
                res = res[1:]
            for rid, state in zip(part, res, strict=True):
                if rid and state != "active":
                    out[rid] = state or ""
        return out

    @staticmethod
    def is_primary(epoch: Epoch, server: dict[str, Any]) -> bool:
        """Whether the node whose ``INFO server`` this is, is the primary of ``epoch``."""
        return _is(epoch, server)

    async def heartbeat(self, router_id: str, epoch: int | None, ttl_s: float) -> Heartbeat:
        """Record that ``router_id`` is alive and has verified ``epoch`` (None: it is leaving);
        durable like a fenced write (``wait_replicas``), so a failover cannot drop a router the
        updater must wait for. Returns every live router's verified epoch and the pool view's
        version (:mod:`pool.store.feed`). The registration is also what the router's capacity
        grants live on (:mod:`pool.store.grants`)."""
        k = self.store.k
        out = await self.store.run_durable(
            self._router,
            [k.routers, k.router_epochs, k.version],
            [router_id, "" if epoch is None else epoch, max(1, int(ttl_s * 1000))],
        )
        routers = {out[i]: int(out[i + 1]) for i in range(1, len(out), 2)}
        return Heartbeat(routers, out[0])

    async def routers(self) -> dict[str, int]:
        """Every live router's verified epoch (a read: expired ones are left out)."""
        k = self.store.k

        async def run() -> list[Any]:
            async with self.store.r.pipeline(transaction=False) as p:
                p.time()
                p.zrange(k.routers, 0, -1, withscores=True)
                p.hgetall(k.router_epochs)
                return list(await p.execute())

        (secs, usecs), live, epochs = await self.store.call(run)
        now_ms = int(secs) * 1000 + int(usecs) // 1000
        return {str(rid): int(epochs.get(rid, 0)) for rid, exp in live if exp > now_ms}

    async def record_lost(
        self,
        info: BoundRollout,
        *,
        session: bool,
        reason: str,
        state: BindingState = BindingState.ABORTED,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> bool:
        """Write the final record of ``info``'s binding, which the failover lost (``state``,
        default aborted, with ``reason``). Returns False if a record exists (it was not lost, or
        is recorded already)."""
        k = self.store.k
        out = await self.store.run_script(
            self._lost,
            [k.binding(info.rollout_id), k.journal, k.gen_outcomes],
            [
                info.rollout_id,
                info.replica_id,
                info.generation,
                info.label,
                info.identity_digest,
                int(session),
                state.value,
                reason,
                prompt_tokens,
                completion_tokens,
                max(1, int(self.store.settings.binding_retention_s * 1000)),
                self.store.journal_maxlen,
            ],
        )
        return out[0] == "ok"


def _is(epoch: Epoch, server: dict[str, Any]) -> bool:
    """Whether the node whose ``INFO server`` this is, is the primary of ``epoch``."""
    if epoch.run_id:
        return bool(server.get("run_id") == epoch.run_id)
    return bool(str(server.get("tcp_port")) == epoch.primary.rpartition(":")[2])


__all__ = [
    "Epoch",
    "Failover",
    "Heartbeat",
    "describe_token",
    "fencing_token",
    "token_epoch",
]
