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

from redis.commands.core import AsyncScript

from pool.errors import StaleFencingToken
from pool.store._client import StoreClient
from pool.store.scripts import PRELUDE
from pool.types import Generation

__all__ = ["HOLDS", "PUBLISH", "Adapters"]

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


# HOLDS — the generations something on a replica may still run.
# KEYS[1] the replica's grants  KEYS[2] their generations  KEYS[3] routers zset
# KEYS[4..] the bindings of the replica's active set (read just before)
# Returns {'ok', generation...} (with repeats) | {'unknown'} (a live grant of unknown generation)
HOLDS = (
    PRELUDE
    + """
local out = {'ok'}
for i = 4, #KEYS do
  local g = redis.call('HGET', KEYS[i], 'generation')
  if g then out[#out + 1] = g end
end
local g = redis.call('HGETALL', KEYS[1])
for i = 1, #g, 2 do
  local exp = tonumber(redis.call('ZSCORE', KEYS[3], g[i]) or '0')
  if tonumber(g[i + 1]) > 0 and exp > now then
    local gen = redis.call('HGET', KEYS[2], g[i])
    if not gen then return {'unknown'} end
    out[#out + 1] = gen
  end
end
return out
"""
)


class Adapters:
    """See the module docstring."""

    def __init__(self, store: StoreClient) -> None:
        self.store = store
        self._publish: AsyncScript = store.r.register_script(PUBLISH)
        self._holds: AsyncScript = store.r.register_script(HOLDS)

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
        keys = [k.granted(replica_id), k.grant_generations(replica_id), k.routers]
        keys += [k.binding(rid) for rid in sorted(members)]
        out = await self.store.run_script(self._holds, keys, [])
        if out[0] == "unknown":
            return None
        return {int(g) for g in out[1:]}
