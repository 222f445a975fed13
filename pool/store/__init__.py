"""The Redis store: replicas, generations, bindings, the updater lease and the journal.

Every state change is one atomic Lua script (compare-then-act, as in redis-py's
``asyncio/lock.py``; :mod:`pool.store.scripts`), registered per store instance and documented
with its KEYS, ARGV and return value. All keys share the hash tag ``{<namespace>}`` so one Redis
Cluster slot holds the whole pool, and every key a script touches arrives through KEYS.

Modules: :mod:`pool.store.scripts` (the Lua), :mod:`pool.store.keys` (key names),
:mod:`pool.store._client` (the redis-py seam: error translation, running scripts),
:mod:`pool.store._reads` (records, bindings, the journal, counts),
:mod:`pool.store.batch` (concurrent ADMIT/RELEASE calls share one round trip),
:mod:`pool.store.connect` (standalone, Sentinel or Cluster clients), :mod:`pool.store.grants`
(capacity routers hold in advance, batched provenance records), :mod:`pool.store.adapters`
(publishing LoRA generations, what holds an adapter), :mod:`pool.store.feed` (the
pool view kept current by a change feed), :mod:`pool.store.lease`
(the updater lease, I8), :mod:`pool.store.failover` (the failover epoch, epoch-qualified
fencing tokens, the router registry), :mod:`pool.store.terms` (what an admission binds: owner,
max age, idle limit, session quota) and the :class:`RedisStore` facade.

Keys (``{ns}`` = ``{rp}`` by default)::

    {ns}:replicas              set of replica ids
    {ns}:replica:<id>          hash: url state generation label identity capacity fence reason
                               target_generation target_label target_identity updated_ms
    {ns}:active:<id>           set of rollout ids with an active binding on the replica
    {ns}:binding:<rollout>     hash: the Binding (kept ``binding_retention_s`` after release)
    {ns}:leases                zset rollout id -> lease expiry (ms, Redis clock)
    {ns}:client:<id>:sessions  set of a client's session ids, for its quota (Terms.quota);
                               ended ones are pruned when the quota refuses; expires with them
    {ns}:session:<rollout>:runs  zset: a session's requests running in any router -> mark
                               expiry (ms); written by router.session_runs
    {ns}:latest                hash: number label identity (the published generation)
    {ns}:generations           hash: number -> GenerationRecord JSON (the newest
                               ``generation_records_max`` declared generations)
    {ns}:labels                hash: label -> number (a label names one generation only)
    {ns}:journal               stream: every admission, release, transition and publish
    {ns}:gen_admissions        hash: generation number -> rollouts admitted on it
    {ns}:gen_outcomes          hash: "<generation>:<finished|aborted|violated>" -> rollouts
    {ns}:updates               hash: update id -> pool.records.UpdateRecord JSON
    {ns}:updates:order         zset: update id -> creation time (ms); the newest
                               ``update_records_max`` records are kept
    {ns}:updater:lease         the updater lease (value = fencing token)
    {ns}:updater:fence         counter the fencing tokens are drawn from (token = epoch<<32 | n)
    {ns}:epochs                hash: primary identity (run id:replication id) -> failover epoch
                               (standalone and Cluster; Sentinel's config-epoch otherwise)
    {ns}:routers               zset: router id -> heartbeat expiry (ms)
    {ns}:routers:epochs        hash: router id -> the failover epoch it last verified
    {ns}:barrier               counter written before a WAIT that confirms earlier writes
                               replicated (``StoreClient.confirm_replicated``)
    {ns}:granted:<id>          hash: router id -> slots it holds in advance on the replica
                               (its grant, :mod:`pool.store.grants`; counted as active)
    {ns}:granted:<id>:gen      hash: router id -> the generation its grant on the replica is on
    {ns}:version               hash: n (counter), v ("<n>:<server time us>"): the pool view's
                               version, moved by every replica change (:mod:`pool.store.feed`)
    {ns}:changes               pub/sub channel: "<version>:<replica id>" after every change

Concurrency and failure contracts:

* Any number of routers may call :meth:`RedisStore.admit`/:meth:`release` concurrently; the
  scripts serialize in Redis. Writes that move a replica's state require the updater lease's
  fencing token (I8); :meth:`taint` takes one too when the updater taints (a fenced-out updater
  writes nothing), and none when a router or an operator closes admissions.
* A cancelled call may or may not have run its script; every mutating script is idempotent or
  reports ``already``/``conflict`` when retried, so callers can safely retry.
* When Redis is unreachable every call raises :class:`~pool.errors.StoreUnavailable` (admissions
  fail closed); nothing is cached locally.
"""

from pool.store._reads import JournalEntry
from pool.store._store import Admission, RedisStore
from pool.store.failover import Epoch, Failover, describe_token, fencing_token, token_epoch
from pool.store.keys import Keys
from pool.store.lease import UpdaterLease
from pool.store.terms import Terms

__all__ = [
    "Admission",
    "Epoch",
    "Failover",
    "JournalEntry",
    "Keys",
    "RedisStore",
    "Terms",
    "UpdaterLease",
    "describe_token",
    "fencing_token",
    "token_epoch",
]
