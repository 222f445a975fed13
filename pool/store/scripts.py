"""The store's Lua scripts, one per atomic state change (compare-then-act, as in redis-py's
``asyncio/lock.py``). Each is registered per :class:`~pool.store.RedisStore` instance; the comment
above each gives its KEYS, ARGV and return value. Every key a script touches arrives through KEYS
(all share the pool's hash tag, so one Redis Cluster slot holds them).
"""

# Shared Lua prelude: server clock in ms, a journal append, the pool-view change feed (bump:
# the view's version moves and every router hears which replica changed; the version is
# "<counter>:<server time in us>", so two primaries never hand out one version for different
# states) and the capacity routers hold in advance on a replica (live_granted: the slots of
# grants whose router's registration is alive; the others are reclaimed on the spot).
PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function journal(key, maxlen, ...)
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'ts', now, ...)
end
local function bump(key, channel, rid)
  local n = redis.call('HINCRBY', key, 'n', 1)
  local v = n .. ':' .. t[1] .. string.format('%06d', tonumber(t[2]))
  redis.call('HSET', key, 'v', v)
  redis.call('PUBLISH', channel, v .. ':' .. rid)
end
local function live_granted(granted, routers)
  local total = 0
  local g = redis.call('HGETALL', granted)
  for i = 1, #g, 2 do
    local exp = tonumber(redis.call('ZSCORE', routers, g[i]) or '0')
    if exp > now then total = total + tonumber(g[i + 1]) else redis.call('HDEL', granted, g[i]) end
  end
  return total
end
"""

# ADMIT — bind a rollout to a replica if I1 holds, in one step.
# KEYS[1] replica hash  KEYS[2] active set  KEYS[3] binding  KEYS[4] leases  KEYS[5] latest
# KEYS[6] journal  KEYS[7] per-generation admission counts  KEYS[8] the client's open sessions
# KEYS[9] the replica's grants (router id -> slots)  KEYS[10] routers zset
# ARGV[1] rollout id  ARGV[2] replica id  ARGV[3] lease ttl ms  ARGV[4] max_staleness
# ARGV[5] min_generation (-1: none)  ARGV[6] exact generation (-1: none)  ARGV[7] session 0|1
# ARGV[8] journal maxlen  ARGV[9] owner ('' = anyone)  ARGV[10] max age ms (0: none)
# ARGV[11] idle limit ms (0: none)  ARGV[12] open sessions the client may have (0: no quota)
# Returns {'ok', generation, label, identity, now} | {'refused', reason, detail}
# The lease never runs past the max age or the idle limit (TOUCH keeps it so), so a binding that
# reaches either expires and the reaper ends it. With a quota, KEYS[8] holds the client's session
# ids (ended ones are pruned by the caller when the quota refuses).
ADMIT = (
    PRELUDE
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
if redis.call('SCARD', KEYS[2]) + live_granted(KEYS[9], KEYS[10]) >= tonumber(r[5]) then
  return {'refused', 'at_capacity', r[5]}
end
local quota = tonumber(ARGV[12])
if quota > 0 and redis.call('SCARD', KEYS[8]) >= quota then
  return {'refused', 'client_quota', ARGV[12]}
end
local exp = now + tonumber(ARGV[3])
local max_age, idle = tonumber(ARGV[10]), tonumber(ARGV[11])
if max_age > 0 then exp = math.min(exp, now + max_age) end
if idle > 0 then exp = math.min(exp, now + idle) end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'rollout_id', ARGV[1], 'replica_id', ARGV[2], 'generation', r[2],
  'label', r[3], 'identity_digest', r[4], 'state', 'active', 'session', ARGV[7],
  'created_ms', now, 'lease_expires_ms', exp, 'requests', 0,
  'prompt_tokens', 0, 'completion_tokens', 0)
if ARGV[9] ~= '' then redis.call('HSET', KEYS[3], 'client', ARGV[9]) end
if max_age > 0 then redis.call('HSET', KEYS[3], 'deadline_ms', now + max_age) end
if idle > 0 then redis.call('HSET', KEYS[3], 'idle_limit_ms', idle, 'last_request_ms', now) end
if quota > 0 then
  redis.call('SADD', KEYS[8], ARGV[1])
  redis.call('PEXPIRE', KEYS[8], math.max(max_age, tonumber(ARGV[3])) + 60000)
end
redis.call('ZADD', KEYS[4], exp, ARGV[1])
redis.call('HINCRBY', KEYS[7], r[2], 1)
journal(KEYS[6], ARGV[8], 'type', 'admit', 'rollout', ARGV[1], 'replica', ARGV[2],
  'generation', r[2])
return {'ok', r[2], r[3], r[4], tostring(now)}
"""
)

# RELEASE — end an active binding exactly once; count its outcome per generation.
# KEYS[1] binding  KEYS[2] active set of the binding's replica  KEYS[3] leases  KEYS[4] journal
# KEYS[5] per-generation outcome counts
# ARGV[1] rollout id  ARGV[2] replica id  ARGV[3] final state  ARGV[4] reason
# ARGV[5] prompt tokens (added)  ARGV[6] completion tokens (added)  ARGV[7] retention ms
# ARGV[8] journal maxlen  ARGV[9] 1: only if the lease has expired (the reaper), else 0
# Returns {'ok'} | {'already', state} | {'unknown'} | {'mismatch', replica} | {'alive', expiry}
RELEASE = (
    PRELUDE
    + """
local b = redis.call('HMGET', KEYS[1], 'state', 'replica_id')
if not b[1] then return {'unknown'} end
if b[2] ~= ARGV[2] then return {'mismatch', b[2]} end
if b[1] ~= 'active' then return {'already', b[1]} end
if ARGV[9] == '1' then
  local exp = redis.call('ZSCORE', KEYS[3], ARGV[1])
  if exp and tonumber(exp) > now then return {'alive', exp} end
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'reason', ARGV[4], 'finished_ms', now)
redis.call('HINCRBY', KEYS[5], redis.call('HGET', KEYS[1], 'generation') .. ':' .. ARGV[3], 1)
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
# ARGV[5] completion tokens added  ARGV[6] 1: a request starts, runs or ends (resets the idle
# clock), 0: a heartbeat (does not)
# Returns {'ok', expires_ms} | {'gone', state-or-''} | {'limit', 'max_age'|'idle', limit ms}
# The lease is extended up to the binding's deadline and idle limit, never past them; a binding
# that has reached either is not touched ('limit': the caller or the reaper ends it).
TOUCH = (
    PRELUDE
    + """
local b = redis.call('HMGET', KEYS[1], 'state', 'deadline_ms', 'created_ms', 'idle_limit_ms',
  'last_request_ms')
if b[1] ~= 'active' then return {'gone', b[1] or ''} end
local deadline = tonumber(b[2])
if deadline and now >= deadline then
  return {'limit', 'max_age', tostring(deadline - tonumber(b[3]))}
end
local idle = tonumber(b[4])
if idle and now >= tonumber(b[5]) + idle then return {'limit', 'idle', b[4]} end
local exp = now + tonumber(ARGV[2])
if deadline then exp = math.min(exp, deadline) end
if idle then
  if ARGV[6] == '1' then
    redis.call('HSET', KEYS[1], 'last_request_ms', now)
    exp = math.min(exp, now + idle)
  else
    exp = math.min(exp, tonumber(b[5]) + idle)
  end
end
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
# ARGV[14] identity of the serving process ('' keeps)
# KEYS[6] view version  KEYS[7] the replica's grants  KEYS[8] routers zset  ARGV[15] change channel
# Returns {'ok', active} | {'stale_token', holder} | {'conflict', state} | {'active', count}
#         | {'unknown'}   (active: bindings + slots routers hold in live grants)
# Entering QUIESCED or UPDATING requires zero active bindings and zero granted slots (I2).
# Entering READY clears an abort of the replica's grants and, with publish=1, moves {ns}:latest
# to the new generation if it is newer (first replica publishes).
TRANSITION = (
    PRELUDE
    + """
local holder = redis.call('GET', KEYS[2])
if holder ~= ARGV[2] then return {'stale_token', holder or ''} end
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return {'unknown'} end
if s ~= ARGV[3] then return {'conflict', s} end
local active = redis.call('SCARD', KEYS[3]) + live_granted(KEYS[7], KEYS[8])
if (ARGV[4] == 'QUIESCED' or ARGV[4] == 'UPDATING') and active > 0 then
  return {'active', tostring(active)}
end
if ARGV[4] == 'READY' then redis.call('HDEL', KEYS[1], 'grants_aborted') end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'fence', ARGV[2], 'reason', ARGV[5],
  'updated_ms', now)
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'generation', ARGV[6], 'label', ARGV[7], 'identity', ARGV[8])
end
if ARGV[14] ~= '' then redis.call('HSET', KEYS[1], 'process', ARGV[14]) end
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
bump(KEYS[6], ARGV[15], ARGV[1])
return {'ok', tostring(active)}
"""
)

# TAINT — close admissions on a replica from any state (it only restricts). The updater's own
# taints are fenced (a fenced-out updater must not write at all: I8); routers' and operators'
# are not (closing admissions is always safe for them).
# KEYS[1] replica hash  KEYS[2] journal  KEYS[3] updater lease  KEYS[4] view version
# ARGV[1] replica id  ARGV[2] reason  ARGV[3] source  ARGV[4] journal maxlen
# ARGV[5] expected state ('' = any)  ARGV[6] fencing token ('' = unfenced)  ARGV[7] change channel
# Returns {'ok', previous} | {'unknown'} | {'conflict', state} | {'stale_token', holder}
TAINT = (
    PRELUDE
    + """
if ARGV[6] ~= '' then
  local holder = redis.call('GET', KEYS[3])
  if holder ~= ARGV[6] then return {'stale_token', holder or ''} end
end
local s = redis.call('HGET', KEYS[1], 'state')
if not s then return {'unknown'} end
if ARGV[5] ~= '' and s ~= ARGV[5] then return {'conflict', s} end
if s == 'TAINTED' then return {'ok', s} end
redis.call('HSET', KEYS[1], 'state', 'TAINTED', 'reason', ARGV[2], 'updated_ms', now)
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'fence', ARGV[6]) end
journal(KEYS[2], ARGV[4], 'type', 'transition', 'replica', ARGV[1], 'from', s, 'to', 'TAINTED',
  'reason', ARGV[2], 'source', ARGV[3], 'fence', ARGV[6])
bump(KEYS[4], ARGV[7], ARGV[1])
return {'ok', s}
"""
)

# DECLARE — record a generation the updater is about to roll out (write-once per number; its
# label is unique among declared generations: the span check and cache_salt rely on it).
# KEYS[1] generations  KEYS[2] updater lease  KEYS[3] latest  KEYS[4] journal  KEYS[5] labels
# ARGV[1] number  ARGV[2] record JSON  ARGV[3] fencing token  ARGV[4] journal maxlen
# ARGV[5] label  ARGV[6] records kept (the newest: older numbers and their labels go; g0's
# record stays: it is the base model a LoRA pool's replicas are recovered on)
# Returns {'ok'} | {'exists'} (same record) | {'conflict', json} | {'stale_token', holder}
#         | {'not_newer', latest} | {'label_taken', number}
DECLARE = (
    PRELUDE
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
local owner = redis.call('HGET', KEYS[5], ARGV[5])
if owner and owner ~= ARGV[1] then return {'label_taken', owner} end
redis.call('HSET', KEYS[5], ARGV[5], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
journal(KEYS[4], ARGV[4], 'type', 'declare', 'generation', ARGV[1], 'fence', ARGV[3])
local keep = tonumber(ARGV[6])
if redis.call('HLEN', KEYS[1]) > keep then
  local cutoff = tonumber(ARGV[1]) - keep
  for _, n in ipairs(redis.call('HKEYS', KEYS[1])) do
    if tonumber(n) <= cutoff and n ~= '0' then redis.call('HDEL', KEYS[1], n) end
  end
  local labels = redis.call('HGETALL', KEYS[5])
  for i = 1, #labels, 2 do
    if tonumber(labels[i + 1]) <= cutoff then redis.call('HDEL', KEYS[5], labels[i]) end
  end
end
return {'ok'}
"""
)

# REGISTER — add a replica (UNINITIALIZED) or update its url/capacity; fenced. A known replica
# whose url changes is TAINTED in the same step unless it is UNINITIALIZED, RECOVERING or
# already TAINTED: another url is another server, which nobody validated, and routers must not
# admit to it on the old record's word (I1, I6).
# KEYS[1] replicas set  KEYS[2] replica hash  KEYS[3] updater lease  KEYS[4] journal
# KEYS[5] view version
# ARGV[1] replica id  ARGV[2] url  ARGV[3] capacity  ARGV[4] token  ARGV[5] journal maxlen
# ARGV[6] change channel
# Returns {'ok', state} (the state after the call) | {'stale_token', holder}
REGISTER = (
    PRELUDE
    + """
local holder = redis.call('GET', KEYS[3])
if holder ~= ARGV[4] then return {'stale_token', holder or ''} end
redis.call('SADD', KEYS[1], ARGV[1])
local r = redis.call('HMGET', KEYS[2], 'state', 'url')
local s = r[1]
if not s then
  s = 'UNINITIALIZED'
  redis.call('HSET', KEYS[2], 'state', s, 'fence', ARGV[4], 'reason', '', 'updated_ms', now)
  journal(KEYS[4], ARGV[5], 'type', 'register', 'replica', ARGV[1], 'url', ARGV[2])
elseif r[2] ~= ARGV[2] and s ~= 'UNINITIALIZED' and s ~= 'RECOVERING' and s ~= 'TAINTED' then
  local why = 'registered at a new address: a server nobody validated'
  redis.call('HSET', KEYS[2], 'state', 'TAINTED', 'fence', ARGV[4], 'reason', why,
    'updated_ms', now)
  journal(KEYS[4], ARGV[5], 'type', 'transition', 'replica', ARGV[1], 'from', s, 'to', 'TAINTED',
    'reason', why, 'source', 'updater', 'fence', ARGV[4])
  s = 'TAINTED'
end
redis.call('HSET', KEYS[2], 'url', ARGV[2], 'capacity', ARGV[3])
bump(KEYS[5], ARGV[6], ARGV[1])
return {'ok', s}
"""
)

# EPOCH — the failover epoch of a primary identified by run id and replication id (standalone
# and Cluster; Sentinel's own config-epoch is used instead where there are sentinels). A
# restarted or newly promoted primary has a new identity and gets the highest epoch + 1.
# KEYS[1] epochs hash (identity -> epoch)  KEYS[2] journal
# ARGV[1] primary identity  ARGV[2] journal maxlen
# Returns the identity's epoch number
EPOCH = (
    PRELUDE
    + """
local e = redis.call('HGET', KEYS[1], ARGV[1])
if e then return tonumber(e) end
local top = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do
  if tonumber(v) > top then top = tonumber(v) end
end
redis.call('HSET', KEYS[1], ARGV[1], top + 1)
journal(KEYS[2], ARGV[2], 'type', 'epoch', 'epoch', top + 1, 'primary', ARGV[1])
return top + 1
"""
)

# ROUTER — a router's heartbeat: it is alive and has verified its in-flight bindings in an
# epoch; routers whose heartbeat expired are dropped.
# KEYS[1] routers zset (router id -> expiry ms)  KEYS[2] router epochs hash (id -> epoch)
# KEYS[3] view version
# ARGV[1] router id  ARGV[2] verified epoch ('' = leaving: drop the router)  ARGV[3] ttl ms
# Returns {view version ('' before the first change), id1, epoch1, id2, epoch2, ...} of the
# live routers (the version is the routers' safety net under the change feed)
ROUTER = (
    PRELUDE
    + """
if ARGV[2] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
local out = {redis.call('HGET', KEYS[3], 'v') or ''}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[2], id) or '0'
end
return out
"""
)

# LOST — write the final record of a binding a failover lost (a request its router still ran,
# or one whose end the old primary confirmed), so every rollout a client saw has a record;
# never overwrites an existing binding.
# KEYS[1] binding  KEYS[2] journal  KEYS[3] per-generation outcome counts
# ARGV[1] rollout id  ARGV[2] replica id  ARGV[3] generation  ARGV[4] label  ARGV[5] identity
# ARGV[6] session 0|1  ARGV[7] final state  ARGV[8] reason  ARGV[9] prompt tokens
# ARGV[10] completion tokens  ARGV[11] retention ms  ARGV[12] journal maxlen
# Returns {'ok'} | {'exists', state}
LOST = (
    PRELUDE
    + """
local s = redis.call('HGET', KEYS[1], 'state')
if s then return {'exists', s} end
redis.call('HSET', KEYS[1], 'rollout_id', ARGV[1], 'replica_id', ARGV[2], 'generation', ARGV[3],
  'label', ARGV[4], 'identity_digest', ARGV[5], 'state', ARGV[7], 'session', ARGV[6],
  'created_ms', now, 'finished_ms', now, 'requests', 0, 'prompt_tokens', ARGV[9],
  'completion_tokens', ARGV[10], 'reason', ARGV[8])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[11]))
redis.call('HINCRBY', KEYS[3], ARGV[3] .. ':' .. ARGV[7], 1)
journal(KEYS[2], ARGV[12], 'type', 'lost', 'rollout', ARGV[1], 'replica', ARGV[2],
  'state', ARGV[7], 'reason', ARGV[8])
return {'ok'}
"""
)
