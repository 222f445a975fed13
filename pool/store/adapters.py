"""Store operations of a pool whose generations are LoRA adapters (:mod:`pool.adapters`).

A LoRA replica moves READY(g) -> READY(g+1) in one fenced ``TRANSITION`` (no drain: the base
weights never change and each request names its adapter) without publishing; once every
replica that validated g+1 has moved, :meth:`Adapters.publish` moves ``{ns}:latest``, so no
replica stops admitting in between (one on g+1 is admissible while g is still the latest).

What may still need an older generation's adapter on a replica (:meth:`Adapters.holds`): its
active bindings (sessions included) and the grants live routers hold on it, each on the
generation the replica served when it was given (``{ns}:granted:<id>:gen``, written by
``GRANT``). Once a replica's record names a newer generation, neither can appear for an older
one (``ADMIT`` binds the record's generation, ``GRANT`` grants it), so a generation found not
held stays not held and its adapter may be unloaded: the reads need not be atomic.

Concurrency: any number of tasks; :meth:`Adapters.publish` is one fenced script. Every call may
raise :class:`~pool.errors.StoreUnavailable`.
"""

from __future__ import annotations

from typing import Any

from redis.commands.core import AsyncScript

from pool.errors import StaleFencingToken
from pool.store._client import StoreClient
from pool.store.scripts import PRELUDE
from pool.types import Generation

__all__ = ["PUBLISH", "Adapters"]

# PUBLISH — fenced: make ``generation`` the published one if it is newer (a LoRA update
# publishes after its replicas moved to it, TRANSITION with publish=0).
# KEYS[1] updater lease  KEYS[2] latest  KEYS[3] journal  KEYS[4] view version
# ARGV[1] fencing token  ARGV[2] number  ARGV[3] label  ARGV[4] identity  ARGV[5] journal maxlen
# ARGV[6] change channel
# Returns {'ok', '1'} (published) | {'ok', '0'} (an equal or newer one already was)
#         | {'stale_token', holder}
PUBLISH = (
    PRELUDE
    + """
local holder = redis.call('GET', KEYS[1])
if holder ~= ARGV[1] then return {'stale_token', holder or ''} end
local cur = tonumber(redis.call('HGET', KEYS[2], 'number'))
if cur and cur >= tonumber(ARGV[2]) then return {'ok', '0'} end
redis.call('HSET', KEYS[2], 'number', ARGV[2], 'label', ARGV[3], 'identity', ARGV[4],
  'published_ms', now)
journal(KEYS[3], ARGV[5], 'type', 'publish', 'generation', ARGV[2], 'label', ARGV[3],
  'replica', '', 'fence', ARGV[1])
bump(KEYS[4], ARGV[6], '')
return {'ok', '1'}
"""
)


class Adapters:
    """See the module docstring."""

    def __init__(self, store: StoreClient) -> None:
        self.store = store
        self._publish: AsyncScript = store.r.register_script(PUBLISH)

    async def publish(self, generation: Generation, identity_digest: str, token: int) -> bool:
        """Publish ``generation`` if it is newer than the published one (True if it moved).
        Raises :class:`StaleFencingToken` if ``token`` no longer holds the updater lease."""
        k = self.store.k
        out = await self.store.run_durable(
            self._publish,
            [k.lease, k.latest, k.journal, k.version],
            [
                token,
                generation.number,
                generation.label,
                identity_digest,
                self.store.journal_maxlen,
                k.changes,
            ],
        )
        if out[0] == "stale_token":
            raise StaleFencingToken(
                f"fencing token {token} is stale (lease held by {out[1] or 'nobody'})",
                token=token,
                holder=out[1],
            )
        return out[1] == "1"

    async def holds(self, replica_id: str) -> set[int] | None:
        """The generations something on ``replica_id`` may still run: those of its active
        bindings and of the grants live routers hold on it. None: a live grant's generation
        is unknown (given by a router older than this record), so every one may be held."""
        k = self.store.k
        members: set[str] = await self.store.call(
            lambda: self.store.r.smembers(k.active(replica_id))
        )

        async def reads() -> list[Any]:
            async with self.store.r.pipeline(transaction=False) as p:
                p.time()
                p.hgetall(k.granted(replica_id))
                p.hgetall(k.grant_generations(replica_id))
                p.zrange(k.routers, 0, -1, withscores=True)
                for rid in sorted(members):
                    p.hget(k.binding(rid), "generation")
                return list(await p.execute())

        res = await self.store.call(reads)
        now_ms = int(res[0][0]) * 1000 + int(res[0][1]) // 1000
        granted, gens, routers = res[1], res[2], dict(res[3])
        held = {int(g) for g in res[4:] if g is not None}
        for router, slots in granted.items():
            if int(slots) <= 0 or float(routers.get(router, 0)) <= now_ms:
                continue  # returned, or its router's registration lapsed (reclaimed)
            if router not in gens:
                return None
            held.add(int(gens[router]))
        return held
