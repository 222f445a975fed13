"""The Lua of capacity grants and batched provenance records (:mod:`pool.store.grants`); the
same conventions as :mod:`pool.store.scripts` (KEYS, ARGV and the return value above each)."""

from pool.store.scripts import PRELUDE

# GRANT — set the slots a router holds in advance on a replica (its grant): growing needs I1
# (READY, an admissible generation, no abort of its grants) and free capacity (bindings and
# every live router's slots count); shrinking (in any state, by a registered router) and
# returning (slots 0, always) are allowed. A
# grant lives while its router's registration does (the failover guard's heartbeat): a dead
# router's slots are reclaimed by whichever script next counts them (live_granted).
# KEYS[1] replica hash  KEYS[2] active set  KEYS[3] the replica's grants  KEYS[4] routers zset
# KEYS[5] latest  KEYS[6] the generation of each router's grant (set when a grant is given,
# dropped when it is returned; pool.store.adapters reads it)
# ARGV[1] router id  ARGV[2] replica id  ARGV[3] slots wanted  ARGV[4] max_staleness
# Returns {'ok', slots, generation, label, identity} (slots may be fewer than wanted, at least 1)
#         | {'returned'} | {'refused', reason, detail}
GRANT = (
    PRELUDE
    + """
local want = tonumber(ARGV[3])
local own = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local r = redis.call('HMGET', KEYS[1], 'state', 'generation', 'label', 'identity', 'capacity',
  'grants_aborted')
if want <= 0 then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[6], ARGV[1])
  return {'returned'}
end
local exp = tonumber(redis.call('ZSCORE', KEYS[4], ARGV[1]) or '0')
if exp <= now then return {'refused', 'unregistered', ARGV[1]} end
if not r[1] then return {'refused', 'unknown_replica', ARGV[2]} end
if want <= own then
  redis.call('HSET', KEYS[3], ARGV[1], want)
  return {'ok', tostring(want), r[2] or '', r[3] or '', r[4] or ''}
end
if r[1] ~= 'READY' then return {'refused', 'not_ready', r[1]} end
if r[6] then return {'refused', 'aborted', r[6]} end
local latest = tonumber(redis.call('HGET', KEYS[5], 'number'))
if not latest then return {'refused', 'no_generation', ''} end
if tonumber(r[2]) < latest - tonumber(ARGV[4]) then
  return {'refused', 'stale_generation', r[2]}
end
local used = redis.call('SCARD', KEYS[2]) + live_granted(KEYS[3], KEYS[4]) - own
local slots = math.min(want, tonumber(r[5]) - used)
if slots <= own then return {'refused', 'at_capacity', r[5]} end
redis.call('HSET', KEYS[3], ARGV[1], slots)
if own == 0 then redis.call('HSET', KEYS[6], ARGV[1], r[2]) end
return {'ok', tostring(slots), r[2], r[3], r[4]}
"""
)

# ABORT_GRANTS — the routers must cut every request they run under a grant on this replica and
# return it (an update's drain ended, the replica was tainted); cleared when the replica is
# READY again (TRANSITION). Routers hear it on the change feed.
# KEYS[1] replica hash  KEYS[2] view version  KEYS[3] the replica's grants  KEYS[4] routers zset
# ARGV[1] replica id  ARGV[2] reason  ARGV[3] change channel
# Returns {'ok', granted slots left} | {'unknown'}
ABORT_GRANTS = (
    PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
redis.call('HSET', KEYS[1], 'grants_aborted', ARGV[2])
bump(KEYS[2], ARGV[3], ARGV[1])
return {'ok', tostring(live_granted(KEYS[3], KEYS[4]))}
"""
)

# RECORDS — the final provenance records of rollouts that ran under grants, written after their
# answers were delivered, many at once; never overwrites a record (a retried batch is a no-op).
# KEYS[1] per-generation admission counts  KEYS[2] per-generation outcome counts  KEYS[3] journal
# KEYS[3 + i] binding of record i
# ARGV[1] retention ms  ARGV[2] journal maxlen  ARGV[3] fields per record (11), then per record:
# rollout id, replica id, generation, label, identity, state, reason, prompt tokens, completion
# tokens, created ms, client ('' = none)
# Returns the number of records written
RECORDS = (
    PRELUDE
    + """
local per = tonumber(ARGV[3])
local written = 0
for i = 1, #KEYS - 3 do
  local b = 3 + (i - 1) * per
  local key = KEYS[3 + i]
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'rollout_id', ARGV[b + 1], 'replica_id', ARGV[b + 2],
      'generation', ARGV[b + 3], 'label', ARGV[b + 4], 'identity_digest', ARGV[b + 5],
      'state', ARGV[b + 6], 'reason', ARGV[b + 7], 'session', '0', 'created_ms', ARGV[b + 10],
      'finished_ms', now, 'requests', 1, 'prompt_tokens', ARGV[b + 8],
      'completion_tokens', ARGV[b + 9])
    if ARGV[b + 11] ~= '' then redis.call('HSET', key, 'client', ARGV[b + 11]) end
    redis.call('PEXPIRE', key, tonumber(ARGV[1]))
    redis.call('HINCRBY', KEYS[1], ARGV[b + 3], 1)
    redis.call('HINCRBY', KEYS[2], ARGV[b + 3] .. ':' .. ARGV[b + 6], 1)
    written = written + 1
  end
end
journal(KEYS[3], ARGV[2], 'type', 'records', 'count', written)
return written
"""
)
