"""The Redis store: replicas, generations, bindings, the updater lease and the journal.

Every state change is one atomic Lua script (compare-then-act, as in redis-py's
``asyncio/lock.py``); each script is registered per store instance and documented with its KEYS,
ARGV and return value. All keys share the hash tag ``{<namespace>}`` so one Redis Cluster slot
holds the whole pool, and every key a script touches arrives through KEYS.

Keys (``{ns}`` = ``{rp}`` by default)::

    {ns}:replicas              set of replica ids
    {ns}:replica:<id>          hash: url state generation label identity capacity fence reason
                               target_generation target_label target_identity updated_ms
    {ns}:active:<id>           set of rollout ids with an active binding on the replica
    {ns}:binding:<rollout>     hash: the Binding (kept ``binding_retention_s`` after release)
    {ns}:leases                zset rollout id -> lease expiry (ms, Redis clock)
    {ns}:latest                hash: number label identity (the published generation)
    {ns}:generations           hash: number -> GenerationRecord JSON (declared generations)
    {ns}:journal               stream: every admission, release, transition and publish
    {ns}:gen_admissions        hash: generation number -> rollouts admitted on it
    {ns}:updates               hash: update id -> the updater's UpdateRecord JSON
    {ns}:updates:order         zset: update id -> creation time (ms)
    {ns}:updater:lease         the updater lease (value = fencing token)
    {ns}:updater:fence         counter the fencing tokens are drawn from

Concurrency and failure contracts:

* Any number of routers may call :meth:`RedisStore.admit`/:meth:`release` concurrently; the
  scripts serialize in Redis. Writes that move a replica's state require the updater lease's
  fencing token (I8), except :meth:`taint`, which only ever closes admissions.
* A cancelled call may or may not have run its script; every mutating script is idempotent or
  reports ``already``/``conflict`` when retried, so callers can safely retry.
* When Redis is unreachable every call raises :class:`~pool.errors.StoreUnavailable` (admissions
  fail closed); nothing is cached locally.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.lock import Lock
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import LockError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pool.errors import (
    AdmissionRefused,
    NotFound,
    RolloutPoolError,
    StaleFencingToken,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)
from pool.settings import StoreSettings
from pool.types import (
    Binding,
    BindingState,
    Generation,
    GenerationRecord,
    ReplicaRecord,
    ReplicaState,
)

# Shared Lua prelude: server clock in ms and a journal append.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function journal(key, maxlen, ...)
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'ts', now, ...)
end
"""

# ADMIT — bind a rollout to a replica if I1 holds, in one step.
# KEYS[1] replica hash  KEYS[2] active set  KEYS[3] binding  KEYS[4] leases  KEYS[5] latest
# KEYS[6] journal  KEYS[7] per-generation admission counts
# ARGV[1] rollout id  ARGV[2] replica id  ARGV[3] lease ttl ms  ARGV[4] max_staleness
# ARGV[5] min_generation (-1: none)  ARGV[6] exact generation (-1: none)  ARGV[7] session 0|1
# ARGV[8] journal maxlen
# Returns {'ok', generation, label, identity, now} | {'refused', reason, detail}
_ADMIT = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return {'refused', 'duplicate_rollout', ARGV[1]} end
local r = redis.call('HMGET', KEYS[1], 'state', 'generation', 'label', 'identity', 'capacity')
if not r[1] then return {'refused', 'unknown_replica', ARGV[2]} end
if r[1] ~= 'READY' then return {'refused', 'not_ready', r[1]} end
local latest = tonumber(redis.call('HGET', KEYS[5], 'number'))
if not latest then return {'refused', 'no_generation', ''} end
local g = tonumber(r[2])
if g < latest - tonumber(ARGV[4]) then return {'refused', 'stale_generation', tostring(g)} end
local ming, exact = tonumber(ARGV[5]), tonumber(ARGV[6])
if ming >= 0 and g < ming then return {'refused', 'below_min_generation', tostring(g)} end
if exact >= 0 and g ~= exact then return {'refused', 'generation_mismatch', tostring(g)} end
if redis.call('SCARD', KEYS[2]) >= tonumber(r[5]) then
  return {'refused', 'at_capacity', r[5]}
end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'rollout_id', ARGV[1], 'replica_id', ARGV[2], 'generation', r[2],
  'label', r[3], 'identity_digest', r[4], 'state', 'active', 'session', ARGV[7],
  'created_ms', now, 'lease_expires_ms', now + tonumber(ARGV[3]), 'requests', 0,
  'prompt_tokens', 0, 'completion_tokens', 0)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HINCRBY', KEYS[7], r[2], 1)
journal(KEYS[6], ARGV[8], 'type', 'admit', 'rollout', ARGV[1], 'replica', ARGV[2],
  'generation', r[2])
return {'ok', r[2], r[3], r[4], tostring(now)}
"""
)

# RELEASE — end an active binding exactly once.
# KEYS[1] binding  KEYS[2] active set of the binding's replica  KEYS[3] leases  KEYS[4] journal
# ARGV[1] rollout id  ARGV[2] replica id  ARGV[3] final state  ARGV[4] reason
# ARGV[5] prompt tokens (added)  ARGV[6] completion tokens (added)  ARGV[7] retention ms
# ARGV[8] journal maxlen
# Returns {'ok'} | {'already', state} | {'unknown'} | {'mismatch', replica}
_RELEASE = (
    _PRELUDE
    + """
local b = redis.call('HMGET', KEYS[1], 'state', 'replica_id')
if not b[1] then return {'unknown'} end
if b[2] ~= ARGV[2] then return {'mismatch', b[2]} end
if b[1] ~= 'active' then return {'already', b[1]} end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'reason', ARGV[4], 'finished_ms', now)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', tonumber(ARGV[5]))
redis.call('HINCRBY', KEYS[1], 'completion_tokens', tonumber(ARGV[6]))
redis.call('HDEL', KEYS[1], 'lease_expires_ms')
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[7]))
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
journal(KEYS[4], ARGV[8], 'type', 'release', 'rollout', ARGV[1], 'replica', ARGV[2],
  'state', ARGV[3], 'reason', ARGV[4])
return {'ok'}
"""
)

# TOUCH — a request of an active binding: extend its lease, count the request and its tokens.
# KEYS[1] binding  KEYS[2] leases
# ARGV[1] rollout id  ARGV[2] lease ttl ms  ARGV[3] requests added  ARGV[4] prompt tokens added
# ARGV[5] completion tokens added
# Returns {'ok', expires_ms} | {'gone', state-or-''}
_TOUCH = (
    _PRELUDE
    + """
local s = redis.call('HGET', KEYS[1], 'state')
if s ~= 'active' then return {'gone', s or ''} end
local exp = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], 'XX', exp, ARGV[1])
redis.call('HSET', KEYS[1], 'lease_expires_ms', exp)
redis.call('HINCRBY', KEYS[1], 'requests', tonumber(ARGV[3]))
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[1], 'completion_tokens', tonumber(ARGV[5]))
return {'ok', tostring(exp)}
"""
)

# TRANSITION — fenced compare-and-set of a replica's state (also begin-drain and publish).
# KEYS[1] replica hash  KEYS[2] updater lease  KEYS[3] active set  KEYS[4] latest
# KEYS[5] journal
# ARGV[1] replica id  ARGV[2] fencing token  ARGV[3] expected state  ARGV[4] new state
# ARGV[5] reason  ARGV[6] generation ('' keeps)  ARGV[7] label  ARGV[8] identity
# ARGV[9] publish 0|1  ARGV[10] target generation ('' clears)  ARGV[11] target label
# ARGV[12] target identity  ARGV[13] journal maxlen
# Returns {'ok', active} | {'stale_token', holder} | {'conflict', state} | {'active', count}
#         | {'unknown'}
# Entering QUIESCED or UPDATING requires zero active bindings (I2). Entering READY with
# publish=1 moves {ns}:latest to the new generation if it is newer (first replica publishes).
_TRANSITION = (
    _PRELUDE
    + """
local holder = redis.call('GET', KEYS[2])
if holder ~= ARGV[2] then return {'stale_token', holder or ''} end
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return {'unknown'} end
if s ~= ARGV[3] then return {'conflict', s} end
local active = redis.call('SCARD', KEYS[3])
if (ARGV[4] == 'QUIESCED' or ARGV[4] == 'UPDATING') and active > 0 then
  return {'active', tostring(active)}
end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'fence', ARGV[2], 'reason', ARGV[5],
  'updated_ms', now)
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'generation', ARGV[6], 'label', ARGV[7], 'identity', ARGV[8])
end
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[1], 'target_generation', ARGV[10], 'target_label', ARGV[11],
    'target_identity', ARGV[12])
elseif ARGV[4] == 'READY' then
  redis.call('HDEL', KEYS[1], 'target_generation', 'target_label', 'target_identity')
end
journal(KEYS[5], ARGV[13], 'type', 'transition', 'replica', ARGV[1], 'from', s, 'to', ARGV[4],
  'fence', ARGV[2], 'generation', ARGV[6], 'reason', ARGV[5])
if ARGV[9] == '1' and ARGV[4] == 'READY' then
  local cur = tonumber(redis.call('HGET', KEYS[4], 'number'))
  if (not cur) or cur < tonumber(ARGV[6]) then
    redis.call('HSET', KEYS[4], 'number', ARGV[6], 'label', ARGV[7], 'identity', ARGV[8],
      'published_ms', now)
    journal(KEYS[5], ARGV[13], 'type', 'publish', 'generation', ARGV[6], 'label', ARGV[7],
      'replica', ARGV[1], 'fence', ARGV[2])
  end
end
return {'ok', tostring(active)}
"""
)

# TAINT — close admissions on a replica from any state (no lease needed: it only restricts).
# KEYS[1] replica hash  KEYS[2] journal
# ARGV[1] replica id  ARGV[2] reason  ARGV[3] source  ARGV[4] journal maxlen
# ARGV[5] expected state ('' = any)
# Returns {'ok', previous} | {'unknown'} | {'conflict', state}
_TAINT = (
    _PRELUDE
    + """
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return {'unknown'} end
if ARGV[5] ~= '' and s ~= ARGV[5] then return {'conflict', s} end
if s == 'TAINTED' then return {'ok', s} end
redis.call('HSET', KEYS[1], 'state', 'TAINTED', 'reason', ARGV[2], 'updated_ms', now)
journal(KEYS[2], ARGV[4], 'type', 'transition', 'replica', ARGV[1], 'from', s, 'to', 'TAINTED',
  'reason', ARGV[2], 'source', ARGV[3])
return {'ok', s}
"""
)

# DECLARE — record a generation the updater is about to roll out (write-once per number).
# KEYS[1] generations  KEYS[2] updater lease  KEYS[3] latest  KEYS[4] journal
# ARGV[1] number  ARGV[2] record JSON  ARGV[3] fencing token  ARGV[4] journal maxlen
# Returns {'ok'} | {'exists'} (same record) | {'conflict', json} | {'stale_token', holder}
#         | {'not_newer', latest}
_DECLARE = (
    _PRELUDE
    + """
local holder = redis.call('GET', KEYS[2])
if holder ~= ARGV[3] then return {'stale_token', holder or ''} end
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  if old == ARGV[2] then return {'exists'} end
  return {'conflict', old}
end
local cur = tonumber(redis.call('HGET', KEYS[3], 'number'))
if cur and cur >= tonumber(ARGV[1]) then return {'not_newer', tostring(cur)} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
journal(KEYS[4], ARGV[4], 'type', 'declare', 'generation', ARGV[1], 'fence', ARGV[3])
return {'ok'}
"""
)

# REGISTER — add a replica (UNINITIALIZED) or update its url/capacity; fenced.
# KEYS[1] replicas set  KEYS[2] replica hash  KEYS[3] updater lease  KEYS[4] journal
# ARGV[1] replica id  ARGV[2] url  ARGV[3] capacity  ARGV[4] token  ARGV[5] journal maxlen
# Returns {'ok', state} | {'stale_token', holder}
_REGISTER = (
    _PRELUDE
    + """
local holder = redis.call('GET', KEYS[3])
if holder ~= ARGV[4] then return {'stale_token', holder or ''} end
redis.call('SADD', KEYS[1], ARGV[1])
local s = redis.call('HGET', KEYS[2], 'state')
if not s then
  s = 'UNINITIALIZED'
  redis.call('HSET', KEYS[2], 'state', s, 'fence', ARGV[4], 'reason', '', 'updated_ms', now)
  journal(KEYS[4], ARGV[5], 'type', 'register', 'replica', ARGV[1], 'url', ARGV[2])
end
redis.call('HSET', KEYS[2], 'url', ARGV[2], 'capacity', ARGV[3])
return {'ok', s}
"""
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


@dataclass(frozen=True)
class JournalEntry:
    id: str
    fields: dict[str, str]

    @property
    def type(self) -> str:
        return self.fields.get("type", "")


class Keys:
    """Key names for one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
        self.p = "{" + namespace + "}"

    replicas = property(lambda self: f"{self.p}:replicas")
    leases = property(lambda self: f"{self.p}:leases")
    latest = property(lambda self: f"{self.p}:latest")
    generations = property(lambda self: f"{self.p}:generations")
    journal = property(lambda self: f"{self.p}:journal")
    gen_admissions = property(lambda self: f"{self.p}:gen_admissions")
    updates = property(lambda self: f"{self.p}:updates")
    updates_order = property(lambda self: f"{self.p}:updates:order")
    lease = property(lambda self: f"{self.p}:updater:lease")
    fence = property(lambda self: f"{self.p}:updater:fence")

    def replica(self, rid: str) -> str:
        return f"{self.p}:replica:{rid}"

    def active(self, rid: str) -> str:
        return f"{self.p}:active:{rid}"

    def binding(self, rollout_id: str) -> str:
        return f"{self.p}:binding:{rollout_id}"


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore:
    """The pool's shared state in Redis. One instance per process; safe for concurrent tasks.

    Construct with :meth:`connect`; close with :meth:`close`. See the module docstring for the
    failure contracts.
    """

    def __init__(self, client: aioredis.Redis, settings: StoreSettings) -> None:
        self.r = client
        self.settings = settings
        self.k = Keys(settings.namespace)
        reg = client.register_script
        self._admit: AsyncScript = reg(_ADMIT)
        self._release: AsyncScript = reg(_RELEASE)
        self._touch: AsyncScript = reg(_TOUCH)
        self._transition: AsyncScript = reg(_TRANSITION)
        self._taint: AsyncScript = reg(_TAINT)
        self._declare: AsyncScript = reg(_DECLARE)
        self._register: AsyncScript = reg(_REGISTER)
        self._maxlen = str(settings.journal_maxlen)

    @classmethod
    def connect(cls, settings: StoreSettings) -> RedisStore:
        client = aioredis.Redis.from_url(
            settings.url,
            username=settings.username,
            password=settings.password.get_secret_value() if settings.password else None,
            decode_responses=True,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.socket_timeout_s,
            retry_on_timeout=False,
            health_check_interval=10,
        )
        return cls(client, settings)

    async def close(self) -> None:
        await self.r.aclose()

    async def _call(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run one redis-py call, translating its errors into the pool's (the seam)."""
        try:
            return await fn()
        except LockError:
            raise  # the lease's own protocol errors; UpdaterLease translates them
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"redis unreachable: {e}", url=self._safe_url()) from e
        except RedisError as e:
            raise StoreError(f"redis error: {e}") from e

    def _safe_url(self) -> str:
        url = self.settings.url
        return url.split("@", 1)[-1] if "@" in url else url

    async def _script(self, script: AsyncScript, keys: list[str], args: list[Any]) -> list[str]:
        out = await self._call(lambda: script(keys=keys, args=[str(a) for a in args]))
        return [str(x) for x in out]

    async def ping(self) -> bool:
        return bool(await self._call(self.r.ping))

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
    ) -> Admission:
        """Bind ``rollout_id`` to ``replica_id`` if I1 holds; raise :class:`AdmissionRefused`.

        Checks, atomically: the replica is READY, its generation is within ``max_staleness`` of
        the published one and meets the constraints, it has capacity, and the rollout id is new.
        Writes the binding, the active set, the lease and a journal entry together.
        """
        lease_ms = _ms(lease_s if lease_s is not None else self.settings.binding_lease_s)
        out = await self._script(
            self._admit,
            [
                self.k.replica(replica_id),
                self.k.active(replica_id),
                self.k.binding(rollout_id),
                self.k.leases,
                self.k.latest,
                self.k.journal,
                self.k.gen_admissions,
            ],
            [
                rollout_id,
                replica_id,
                lease_ms,
                max_staleness,
                -1 if min_generation is None else min_generation,
                -1 if generation is None else generation,
                int(session),
                self._maxlen,
            ],
        )
        if out[0] != "ok":
            raise AdmissionRefused(out[1], replica=replica_id, detail=out[2] or None)
        return Admission(rollout_id, replica_id, int(out[1]), out[2], out[3], int(out[4]))

    async def release(
        self,
        rollout_id: str,
        replica_id: str,
        state: BindingState = BindingState.FINISHED,
        *,
        reason: str = "",
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> bool:
        """End an active binding. Returns False if it had already ended (idempotent).

        Raises :class:`NotFound` for an unknown rollout and :class:`StoreConflict` if the
        binding belongs to another replica.
        """
        if state is BindingState.ACTIVE:
            raise ValueError("release needs a final state")
        out = await self._script(
            self._release,
            [
                self.k.binding(rollout_id),
                self.k.active(replica_id),
                self.k.leases,
                self.k.journal,
            ],
            [
                rollout_id,
                replica_id,
                state.value,
                reason,
                prompt_tokens,
                completion_tokens,
                _ms(self.settings.binding_retention_s),
                self._maxlen,
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
    ) -> int:
        """Extend an active binding's lease (heartbeat) and add request/token counts.

        Returns the new expiry (ms). Raises :class:`NotFound` if the binding is not active.
        """
        lease_ms = _ms(lease_s if lease_s is not None else self.settings.binding_lease_s)
        out = await self._script(
            self._touch,
            [self.k.binding(rollout_id), self.k.leases],
            [rollout_id, lease_ms, requests, prompt_tokens, completion_tokens],
        )
        if out[0] != "ok":
            raise NotFound(
                f"rollout {rollout_id} is not active ({out[1] or 'unknown'})",
                rollout_id=rollout_id,
                state=out[1] or None,
            )
        return int(out[1])

    async def reap_expired(self, limit: int = 100) -> list[str]:
        """Abort bindings whose lease expired (e.g. their router died). Returns their ids.

        Safe to run from many processes at once: each binding is released exactly once.
        """
        now_s, now_us = await self._call(self.r.time)
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        ids: list[str] = await self._call(
            lambda: self.r.zrangebyscore(self.k.leases, "-inf", now_ms, start=0, num=limit)
        )
        reaped: list[str] = []
        for rid in ids:
            key = self.k.binding(rid)
            replica = await self._call(partial(self.r.hget, key, "replica_id"))
            if replica is None:
                await self._call(partial(self.r.zrem, self.k.leases, rid))
                continue
            if await self.release(rid, str(replica), BindingState.ABORTED, reason="lease expired"):
                reaped.append(rid)
        return reaped

    async def abort_active(self, replica_id: str, reason: str) -> list[str]:
        """Mark every active binding on a replica aborted (crash, drain timeout). Returns ids."""
        ids: set[str] = await self._call(lambda: self.r.smembers(self.k.active(replica_id)))
        done = []
        for rid in sorted(ids):
            if await self.release(rid, replica_id, BindingState.ABORTED, reason=reason):
                done.append(rid)
        return done

    # ---------------------------------------------------------------- replicas (updater)

    async def register_replica(
        self, replica_id: str, url: str, token: int, capacity: int = 64
    ) -> ReplicaState:
        out = await self._script(
            self._register,
            [self.k.replicas, self.k.replica(replica_id), self.k.lease, self.k.journal],
            [replica_id, url, capacity, token, self._maxlen],
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
    ) -> int:
        """Fenced compare-and-set ``expected`` → ``new``. Returns the replica's active count.

        Raises :class:`StaleFencingToken` if ``token`` no longer holds the updater lease,
        :class:`StoreConflict` if the state is not ``expected`` or if entering QUIESCED/UPDATING
        with active bindings (I2), :class:`NotFound` for an unknown replica. ``publish`` with
        ``new == READY`` publishes ``generation`` if it is newer than the published one.
        """
        out = await self._script(
            self._transition,
            [
                self.k.replica(replica_id),
                self.k.lease,
                self.k.active(replica_id),
                self.k.latest,
                self.k.journal,
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
                self._maxlen,
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

    async def begin_drain(
        self, replica_id: str, token: int, target: Generation, target_identity: str
    ) -> int:
        """READY → DRAINING (closes admissions at the CAS). Returns active bindings left."""
        return await self.transition(
            replica_id,
            token,
            ReplicaState.READY,
            ReplicaState.DRAINING,
            reason=f"update to {target.label}",
            target=target,
            target_identity=target_identity,
        )

    async def taint(
        self, replica_id: str, reason: str, *, source: str, expected: ReplicaState | None = None
    ) -> ReplicaState:
        """Move a replica to TAINTED from any state (or only from ``expected``).

        Needs no lease: it only closes admissions. Returns the previous state.
        """
        out = await self._script(
            self._taint,
            [self.k.replica(replica_id), self.k.journal],
            [replica_id, reason, source, self._maxlen, "" if expected is None else expected.value],
        )
        if out[0] == "unknown":
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        if out[0] == "conflict":
            raise StoreConflict(f"replica {replica_id} is {out[1]}", replica=replica_id)
        return ReplicaState(out[1])

    # ---------------------------------------------------------------- generations

    async def declare_generation(self, record: GenerationRecord, token: int) -> bool:
        """Record a generation before rolling it out. Returns False if already declared
        identically; raises :class:`StoreConflict` for a different record or a number that is
        not newer than the published generation."""
        out = await self._script(
            self._declare,
            [self.k.generations, self.k.lease, self.k.latest, self.k.journal],
            [record.generation.number, record.model_dump_json(), token, self._maxlen],
        )
        self._check_token(out, token)
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

    async def generation_record(self, number: int) -> GenerationRecord:
        raw = await self._call(lambda: self.r.hget(self.k.generations, str(number)))
        if raw is None:
            raise NotFound(f"generation {number} was never declared", generation=number)
        return GenerationRecord.model_validate_json(raw)

    async def generation_records(self) -> list[GenerationRecord]:
        raw: dict[str, str] = await self._call(lambda: self.r.hgetall(self.k.generations))
        recs = [GenerationRecord.model_validate_json(v) for v in raw.values()]
        return sorted(recs, key=lambda r: r.generation.number)

    async def latest(self) -> tuple[Generation, str] | None:
        """The published generation and its identity digest, or None before the first."""
        h: dict[str, str] = await self._call(lambda: self.r.hgetall(self.k.latest))
        if not h:
            return None
        return Generation(number=int(h["number"]), label=h["label"]), h.get("identity", "")

    # ---------------------------------------------------------------- reads

    async def replica(self, replica_id: str) -> ReplicaRecord:
        recs = await self._replicas([replica_id])
        if not recs:
            raise NotFound(f"unknown replica {replica_id}", replica=replica_id)
        return recs[0]

    async def replicas(self) -> list[ReplicaRecord]:
        ids: set[str] = await self._call(lambda: self.r.smembers(self.k.replicas))
        return await self._replicas(sorted(ids))

    async def _replicas(self, ids: Iterable[str]) -> list[ReplicaRecord]:
        ids = list(ids)

        async def run() -> list[Any]:
            async with self.r.pipeline(transaction=False) as p:
                for rid in ids:
                    p.hgetall(self.k.replica(rid))
                    p.scard(self.k.active(rid))
                return list(await p.execute())

        res = await self._call(run)
        out = []
        for i, rid in enumerate(ids):
            h, active = res[2 * i], res[2 * i + 1]
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
                )
            )
        return out

    async def active_rollouts(self, replica_id: str) -> set[str]:
        ids: set[str] = await self._call(lambda: self.r.smembers(self.k.active(replica_id)))
        return ids

    async def binding(self, rollout_id: str) -> Binding:
        h: dict[str, str] = await self._call(lambda: self.r.hgetall(self.k.binding(rollout_id)))
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
        )

    async def journal(
        self, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[JournalEntry]:
        rows = await self._call(lambda: self.r.xrange(self.k.journal, start, end, count=count))
        return [JournalEntry(str(i), {str(k): str(v) for k, v in f.items()}) for i, f in rows]

    async def generation_admissions(self) -> dict[int, int]:
        """Rollouts admitted per generation number (counted by the ADMIT script)."""
        raw = await self._call(lambda: self.r.hgetall(self.k.gen_admissions))
        return {int(g): int(n) for g, n in raw.items()}

    async def leased_rollouts(self) -> int:
        n: int = await self._call(lambda: self.r.zcard(self.k.leases))
        return n

    # ---------------------------------------------------------------- update records

    async def save_update(self, update_id: str, created_ms: int, record_json: str) -> None:
        """Write (or overwrite) an update record. Records are the updater's, not routers'."""

        async def run() -> None:
            async with self.r.pipeline(transaction=True) as p:
                p.hset(self.k.updates, update_id, record_json)
                p.zadd(self.k.updates_order, {update_id: created_ms})
                await p.execute()

        await self._call(run)

    async def update_json(self, update_id: str) -> str:
        raw = await self._call(lambda: self.r.hget(self.k.updates, update_id))
        if raw is None:
            raise NotFound(f"unknown update {update_id}", update_id=update_id)
        return str(raw)

    async def updates_json(self, limit: int = 100) -> list[str]:
        """The newest ``limit`` update records, newest first."""
        ids = await self._call(lambda: self.r.zrevrange(self.k.updates_order, 0, limit - 1))
        if not ids:
            return []
        raw = await self._call(lambda: self.r.hmget(self.k.updates, ids))
        return [str(x) for x in raw if x is not None]

    # ---------------------------------------------------------------- lease (I8)

    def updater_lease(self, owner: str | None = None) -> UpdaterLease:
        return UpdaterLease(self, owner or uuid.uuid4().hex)

    @staticmethod
    def _check_token(out: list[str], token: int) -> None:
        if out[0] == "stale_token":
            raise StaleFencingToken(
                f"fencing token {token} does not hold the updater lease "
                f"(holder: {out[1] or 'none'})",
                token=token,
            )


class UpdaterLease:
    """The one-updater-at-a-time lease (I8), built on redis-py's :class:`~redis.asyncio.lock.Lock`.

    The lock's value is a fencing token drawn from a counter (``INCR``), so tokens grow with every
    acquisition and every fenced script compares its token with the lock's current value: a
    stale updater whose lease expired can no longer write. ``acquire`` blocks up to
    ``blocking_timeout_s`` (None: forever). Call :meth:`extend` well within ``updater_lease_s``;
    :meth:`keep_alive` does it for you. Cancelling ``acquire`` leaves no lease behind.
    """

    def __init__(self, store: RedisStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self.token: int | None = None
        self._lock = Lock(
            store.r,
            store.k.lease,
            timeout=store.settings.updater_lease_s,
            sleep=0.1,
            thread_local=False,
        )

    async def acquire(self, blocking_timeout_s: float | None = None) -> int:
        token = int(await self.store._call(lambda: self.store.r.incr(self.store.k.fence)))
        ok = await self.store._call(
            lambda: self._lock.acquire(
                blocking=True, blocking_timeout=blocking_timeout_s, token=str(token)
            )
        )
        if not ok:
            raise StoreConflict("updater lease is held by another updater", token=token)
        self.token = token
        return token

    def require(self) -> int:
        if self.token is None:
            raise StaleFencingToken("updater lease not held")
        return self.token

    async def extend(self) -> None:
        try:
            await self.store._call(lambda: self._lock.reacquire())
        except LockError as e:
            self.token = None
            raise StaleFencingToken(f"updater lease lost: {e}") from e

    async def release(self) -> None:
        if self.token is None:
            return
        try:
            await self.store._call(self._lock.release)
        except LockError:
            pass
        except RolloutPoolError:
            pass
        self.token = None

    async def keep_alive(self, interval_s: float | None = None) -> None:
        """Extend the lease every ``interval_s`` until cancelled; raises once the lease is lost."""
        interval = interval_s or self.store.settings.updater_lease_s / 3
        while True:
            await asyncio.sleep(interval)
            await self.extend()

    @asynccontextmanager
    async def held(self, blocking_timeout_s: float | None = None) -> AsyncIterator[int]:
        token = await self.acquire(blocking_timeout_s)
        try:
            yield token
        finally:
            await self.release()
