"""The Redis store against a real ``redis-server`` (started by the session fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any

import pytest
from pydantic import SecretStr

from pool.errors import (
    AdmissionRefused,
    LimitReached,
    NotFound,
    StaleFencingToken,
    StoreBusy,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)
from pool.records import UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore, Terms
from pool.types import BindingState, Generation, GenerationRecord, ReplicaState, WeightIdentity
from testkit.redis_server import free_port
from tests.helpers import active_rollouts, begin_drain, generation_outcomes, refused_port

S = ReplicaState
G0, G1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")


def ident(step: int) -> WeightIdentity:
    return WeightIdentity(manifest_digest="sha256:m", checkpoint_uri=f"/ckpt/{step}", step=step)


async def ready_replica(store: RedisStore, token: int, rid: str = "r0", capacity: int = 64) -> None:
    await store.register_replica(rid, f"http://{rid}", token, capacity=capacity)
    await store.transition(
        rid, token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )


def test_identity_distinguishes_checkpoints_of_one_architecture() -> None:
    a, b = ident(1), ident(2)
    assert a.manifest_digest == b.manifest_digest
    assert a.digest != b.digest
    assert ident(1).digest == a.digest


async def test_admit_release_and_provenance(store: RedisStore) -> None:
    lease = store.updater_lease()
    token = await lease.acquire()
    await ready_replica(store, token)
    assert await store.latest() == (G0, "id0")
    adm = await store.admit("ro1", "r0")
    assert (adm.generation, adm.label, adm.identity_digest) == (0, "g0", "id0")
    assert (await store.replica("r0")).active == 1
    assert await store.generation_admissions() == {0: 1}
    assert await store.release("ro1", "r0", prompt_tokens=3, completion_tokens=7)
    assert not await store.release("ro1", "r0")  # idempotent
    b = await store.binding("ro1")
    assert b.state is BindingState.FINISHED and b.completion_tokens == 7 and b.finished_ms
    assert (await store.replica("r0")).active == 0
    types = [e.type for e in await store.journal()]
    assert types == ["epoch", "register", "transition", "publish", "admit", "release"]
    with pytest.raises(NotFound):
        await store.release("nope", "r0")
    with pytest.raises(StoreConflict):
        await store.release("ro1", "r1")


async def test_admission_refusals_name_their_reason(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("x", "ghost")
    assert e.value.reason == "unknown_replica"
    await store.register_replica("r0", "http://r0", token, capacity=1)
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("x", "r0")
    assert e.value.reason == "not_ready"
    await store.transition("r0", token, S.UNINITIALIZED, S.READY, generation=G0, publish=True)
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("x", "r0", min_generation=1)
    assert e.value.reason == "below_min_generation"
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("x", "r0", generation=3)
    assert e.value.reason == "generation_mismatch"
    await store.admit("x", "r0")
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("x", "r0")
    assert e.value.reason == "duplicate_rollout"
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("y", "r0")
    assert e.value.reason == "at_capacity"
    assert e.value.to_dict()["error"]["reason"] == "at_capacity"


async def test_staleness_after_publish(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    await ready_replica(store, token, "r0")
    await ready_replica(store, token, "r1")
    await store.declare_generation(GenerationRecord(generation=G1, identity=ident(1)), token)
    await begin_drain(store, "r1", token, G1, "id1")
    for a, b in [
        (S.DRAINING, S.QUIESCED),
        (S.QUIESCED, S.UPDATING),
        (S.UPDATING, S.INVALIDATING),
        (S.INVALIDATING, S.VALIDATING),
        (S.VALIDATING, S.RESUMING),
    ]:
        await store.transition("r1", token, a, b)
    await store.admit("before", "r0")  # g0 still latest
    await store.transition(
        "r1", token, S.RESUMING, S.READY, generation=G1, identity_digest="id1", publish=True
    )
    assert await store.latest() == (G1, "id1")
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("after", "r0")  # max_staleness=0: r0 stops admitting at publish
    assert e.value.reason == "stale_generation"
    assert (await store.admit("stale-ok", "r0", max_staleness=1)).generation == 0
    assert (await store.admit("fresh", "r1")).generation == 1
    r1 = await store.replica("r1")
    assert (r1.generation, r1.label, r1.identity_digest) == (1, "g1", "id1")


async def test_quiesce_and_update_refused_with_active_bindings(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    await store.admit("busy", "r0")
    assert await begin_drain(store, "r0", token, G1, "id1") == 1
    with pytest.raises(AdmissionRefused):
        await store.admit("late", "r0")
    with pytest.raises(StoreConflict) as e:
        await store.transition("r0", token, S.DRAINING, S.QUIESCED)
    assert e.value.context["active"] == 1
    await store.release("busy", "r0")
    assert await store.transition("r0", token, S.DRAINING, S.QUIESCED) == 0
    with pytest.raises(StoreConflict):  # CAS: the state is no longer DRAINING
        await store.transition("r0", token, S.DRAINING, S.QUIESCED)


async def test_fencing_rejects_a_stale_updater(store: RedisStore) -> None:
    old = store.updater_lease("old")
    t_old = await old.acquire()
    await ready_replica(store, t_old)
    await old.release()
    new = store.updater_lease("new")
    t_new = await new.acquire(blocking_timeout_s=1)
    assert t_new > t_old
    with pytest.raises(StaleFencingToken):
        await begin_drain(store, "r0", t_old, G1, "id1")
    with pytest.raises(StaleFencingToken):
        await store.declare_generation(GenerationRecord(generation=G1, identity=ident(1)), t_old)
    await begin_drain(store, "r0", t_new, G1, "id1")
    assert (await store.replica("r0")).fence == t_new


async def test_second_updater_waits_on_the_lease(store_settings: StoreSettings) -> None:
    settings = store_settings.model_copy(update={"updater_lease_s": 0.5})
    store = RedisStore.connect(settings)
    try:
        first = store.updater_lease("a")
        await first.acquire()
        second = store.updater_lease("b")
        with pytest.raises(StoreConflict):
            await second.acquire(blocking_timeout_s=0.2)
        # the first stops renewing (crashed): its lease expires and the second gets in
        t2 = await second.acquire(blocking_timeout_s=3)
        with pytest.raises(StaleFencingToken):
            await first.extend()
        assert t2 == second.require()
    finally:
        await store.close()


async def test_taint_needs_no_lease_and_closes_admissions(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    assert await store.taint("r0", "weight_versions mismatch", source="router") is S.READY
    with pytest.raises(AdmissionRefused):
        await store.admit("x", "r0")
    with pytest.raises(StoreConflict):
        await store.transition("r0", token, S.READY, S.DRAINING)


async def test_reaper_aborts_orphans_once(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    await store.admit("orphan", "r0", lease_s=0.05)
    await store.admit("alive", "r0", lease_s=30)
    await asyncio.sleep(0.1)
    reaped = await asyncio.gather(store.reap_expired(), store.reap_expired())
    assert sorted(reaped[0] + reaped[1]) == ["orphan"]
    b = await store.binding("orphan")
    assert b.state is BindingState.ABORTED and b.reason == "lease expired"
    assert await active_rollouts(store, "r0") == {"alive"}
    with pytest.raises(NotFound):
        await store.touch("orphan")
    exp = await store.touch("alive", requests=1, completion_tokens=5, lease_s=60)
    assert exp > b.created_ms
    assert (await store.binding("alive")).completion_tokens == 5


async def test_a_heartbeated_session_ends_at_its_max_age(store: RedisStore) -> None:
    """A heartbeating session lived forever (and kept a replica
    DRAINING under drain_policy wait). No touch extends the lease past the max age; at it the
    session expires and the reaper ends it with that reason. The checks before the max age
    must end within it: when they took longer (a stalled test process), a ``LimitReached``
    proves nothing and they are redone on a fresh session."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    terms = Terms(owner="key:a", max_age_s=0.3, idle_s=60)
    loop = asyncio.get_running_loop()
    for attempt in range(5):
        sid = f"s{attempt}"
        t0 = loop.time()
        await store.admit(sid, "r0", session=True, lease_s=60, terms=terms)
        try:
            b = await store.binding(sid)
            assert b.client == "key:a" and b.deadline_ms == b.created_ms + 300
            assert b.lease_expires_ms == b.deadline_ms
            assert await store.touch(sid, lease_s=60, activity=False) == b.deadline_ms
            assert await store.touch(sid, lease_s=60, requests=1) == b.deadline_ms
            break
        except LimitReached:
            if loop.time() - t0 < terms.max_age_s:
                raise
            await store.release(sid, "r0", BindingState.ABORTED)  # past its age: again
    else:
        pytest.fail("the checks never ended within the session's max age")
    await asyncio.sleep(0.35)
    for activity in (False, True):
        with pytest.raises(LimitReached) as e:
            await store.touch(sid, lease_s=60, activity=activity)
        assert e.value.reason == "session reached its maximum age of 0.3 s"
    assert await store.renew({sid: 60.0}) == {sid}  # nothing left to renew
    assert await store.reap_expired() == [sid]
    b = await store.binding(sid)
    assert (b.state, b.reason) == (BindingState.ABORTED, "session reached its maximum age of 0.3 s")


async def test_a_session_without_requests_ends_at_its_idle_limit(store: RedisStore) -> None:
    """Heartbeats keep a session's lease but not its activity: without a request for
    ``idle_s`` it ends; a request, or a renewal while one runs, resets the clock.
    The checks before the limit are redone on a fresh session when they took longer than it
    (a ``LimitReached`` then proves nothing)."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    loop = asyncio.get_running_loop()
    for attempt in range(5):
        sid = f"i{attempt}"
        t0 = loop.time()
        await store.admit(sid, "r0", session=True, lease_s=60, terms=Terms(idle_s=0.3))
        try:
            b = await store.binding(sid)
            assert b.idle_limit_ms == 300 and b.last_request_ms == b.created_ms
            assert b.client == ""
            assert await store.touch(sid, lease_s=60, activity=False) == b.created_ms + 300
            exp = await store.touch(sid, lease_s=60, requests=1)  # a request: the clock restarts
            active = (await store.binding(sid)).last_request_ms
            assert active is not None and exp == active + 300
            await store.renew({sid: 60.0})  # a request still running: activity too
            renewed = (await store.binding(sid)).last_request_ms
            assert renewed is not None and renewed >= active
            break
        except LimitReached:
            if loop.time() - t0 < 0.3:
                raise
            await store.release(sid, "r0", BindingState.ABORTED)  # idle too long: again
    else:
        pytest.fail("the checks never ended within the session's idle limit")
    await asyncio.sleep(0.35)
    for activity in (False, True):  # a late request does not revive it
        with pytest.raises(LimitReached) as e:
            await store.touch(sid, lease_s=60, activity=activity)
        assert e.value.reason == "session idle: no request for 0.3 s"
    assert await store.reap_expired() == [sid]
    assert (await store.binding(sid)).reason == "session idle: no request for 0.3 s"


async def test_a_clients_open_sessions_are_capped_in_redis(store: RedisStore) -> None:
    """Per-client session quota, counted by ADMIT so every router sees the same
    count; ended sessions (closed, reaped, aborted) are pruned when the quota refuses."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)

    def terms(client: str) -> Terms:
        return Terms(owner=client, max_age_s=60, quota_key=client, quota=2)

    await store.admit("a1", "r0", session=True, terms=terms("key:a"))
    await store.admit("a2", "r0", session=True, terms=terms("key:a"))
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("a3", "r0", session=True, terms=terms("key:a"))
    assert e.value.reason == "client_quota"
    await store.admit("b1", "r0", session=True, terms=terms("key:b"))  # another client
    await store.abort_active("r0", "drain deadline")  # a1, a2 (and b1) end elsewhere
    await store.admit("a3", "r0", session=True, terms=terms("key:a"))
    await store.admit("a4", "r0", session=True, terms=terms("key:a"))
    key = store.k.client_sessions("key:a")
    assert await store.r.smembers(key) == {"a3", "a4"}
    assert 0 < await store.r.pttl(key) <= 120_000


async def test_a_quota_refusal_after_another_routers_prune_is_tried_again(
    store: RedisStore, store_settings: StoreSettings
) -> None:
    """A client's session set full of ended sessions, and two routers admitting for it at
    once: both are refused by the count, and the other router's prune empties the set before
    this one reads it. This prune then removes nothing, yet the set has room: the admission
    must be tried again, not refused (clients of two routers got 429 ``client_sessions`` with
    fewer sessions open than their quota). The interleaving is forced: this router's prune
    starts only once the other one's has ended."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    terms = Terms(owner="key:a", max_age_s=60, quota_key="key:a", quota=2)
    await store.admit("a1", "r0", session=True, terms=terms)
    await store.admit("a2", "r0", session=True, terms=terms)
    await store.abort_active("r0", "ended")  # the set is full, of ended sessions only
    other = RedisStore.connect(store_settings)

    class Late(RedisStore):
        async def _prune(self, sessions_key: str) -> int:
            assert await other._prune(sessions_key) == 2  # the other router's, first
            return await super()._prune(sessions_key)

    late = Late(store.r, store.settings)
    try:
        adm = await late.admit("a3", "r0", session=True, terms=terms)
        assert adm.rollout_id == "a3"
        assert await store.r.smembers(store.k.client_sessions("key:a")) == {"a3"}
    finally:
        await other.close()


async def test_declare_generation_is_write_once_and_monotonic(store: RedisStore) -> None:
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    rec = GenerationRecord(generation=G1, identity=ident(1))
    assert await store.declare_generation(rec, token)
    assert not await store.declare_generation(rec, token)
    with pytest.raises(StoreConflict):
        await store.declare_generation(GenerationRecord(generation=G1, identity=ident(9)), token)
    with pytest.raises(StoreConflict):
        await store.declare_generation(GenerationRecord(generation=G0, identity=ident(0)), token)
    assert (await store.generation_record(1)).identity == ident(1)


async def test_admissions_fail_closed_when_redis_is_unreachable() -> None:
    store = RedisStore.connect(
        StoreSettings(url=f"redis://127.0.0.1:{refused_port()}/0", socket_timeout_s=0.5)
    )
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.admit("x", "r0")
        assert "unreachable" in e.value.message
    finally:
        await store.close()


async def test_no_admission_lands_after_the_drain_cas(store: RedisStore) -> None:
    """Many tasks admit while a drain commits: zero admissions after the CAS (journal order)."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token, capacity=100_000)
    admitted: list[str] = []
    stop = asyncio.Event()

    async def admitter(i: int) -> None:
        n = 0
        while not stop.is_set():
            rid = f"c{i}-{n}"
            n += 1
            try:
                await store.admit(rid, "r0")
                admitted.append(rid)
            except AdmissionRefused as e:
                assert e.reason == "not_ready"
                return

    tasks = [asyncio.create_task(admitter(i)) for i in range(32)]
    await asyncio.sleep(0.05)
    await begin_drain(store, "r0", token, G1, "id1")
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    stop.set()
    entries = await store.journal()
    cas = next(i for i, e in enumerate(entries) if e.fields.get("to") == "DRAINING")
    after = [e for e in entries[cas:] if e.type == "admit"]
    assert admitted and after == []
    assert len([e for e in entries if e.type == "admit"]) == len(admitted)
    assert await active_rollouts(store, "r0") == set(admitted)


async def test_unique_namespaces_isolate(redis_server) -> None:  # type: ignore[no-untyped-def]
    a = RedisStore.connect(StoreSettings(url=redis_server.url, namespace=uuid.uuid4().hex[:8]))
    b = RedisStore.connect(StoreSettings(url=redis_server.url, namespace=uuid.uuid4().hex[:8]))
    try:
        token = await a.updater_lease().acquire()
        await ready_replica(a, token)
        assert await b.replicas() == []
        assert [r.replica_id for r in await a.replicas()] == ["r0"]
    finally:
        await a.close()
        await b.close()


async def test_acl_user_and_bindings_survive_a_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Connect as an ACL user with a password; script-written state survives a clean restart
    (AOF). On Redis 7.0 this fails if the default user is disabled (see RedisServer)."""
    from testkit.redis_server import RedisServer

    server = RedisServer(tmp_path, username="pool", password="pw-123").start()
    settings = StoreSettings(url=server.url, username="pool", password="pw-123", namespace="acl")
    store = RedisStore.connect(settings)
    try:
        token = await store.updater_lease().acquire()
        await ready_replica(store, token)
        await store.admit("kept", "r0")
        with pytest.raises(StoreUnavailable):
            bad = RedisStore.connect(settings.model_copy(update={"password": SecretStr("wrong")}))
            try:
                await bad.ping()
            finally:
                await bad.close()
        server.stop()
        server = RedisServer(tmp_path, port=server.port, username="pool", password="pw-123")
        server.start()
        for _ in range(20):  # the pooled connection notices the restart
            try:
                b = await store.binding("kept")
                break
            except StoreUnavailable:
                await asyncio.sleep(0.05)
        assert b.state is BindingState.ACTIVE and b.replica_id == "r0"
        assert (await store.replica("r0")).active == 1
    finally:
        await store.close()
        server.stop()


async def test_reaper_leaves_a_binding_renewed_after_its_scan(store: RedisStore) -> None:
    """The reaper read expired ids, then released them; a heartbeat
    that renewed the lease in between was overridden and a live rollout aborted. The expiry is
    now re-checked inside the release script."""
    token = await store.updater_lease().acquire()
    await ready_replica(store, token)
    await store.admit("beating", "r0", lease_s=0.05)
    await asyncio.sleep(0.1)  # expired: the next scan lists it
    real_release = store.release

    async def renewed_meanwhile(*args: Any, **kw: Any) -> bool:
        await store.touch("beating", lease_s=30)  # the heartbeat lands between scan and release
        return await real_release(*args, **kw)

    store.release = renewed_meanwhile  # type: ignore[method-assign]
    assert await store.reap_expired() == []
    assert (await store.binding("beating")).state is BindingState.ACTIVE


async def test_unreachable_redis_errors_never_show_credentials() -> None:
    """The Redis URL with its ?password= was echoed in 503 bodies and
    /healthz. Errors carry the URL without credentials."""
    url = f"redis://svc:hunter2@127.0.0.1:{free_port()}/0?password=hunter3&socket_timeout=1"
    store = RedisStore.connect(StoreSettings(url=url, socket_timeout_s=0.5))
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.admit("x", "r0")
        text = json.dumps(e.value.to_dict()) + e.value.message
        assert "hunter" not in text and "svc" not in text
        assert "127.0.0.1" in text
    finally:
        await store.close()


async def test_a_burst_of_concurrent_calls_is_served_not_refused(
    store_settings: StoreSettings,
) -> None:
    """Audit finding: >100 concurrent store calls got 503 store_unavailable while
    Redis was healthy (redis-py's default non-blocking pool). Calls now wait for a pooled
    connection."""
    store = RedisStore.connect(store_settings.model_copy(update={"max_connections": 8}))
    try:
        token = await store.updater_lease().acquire()
        await store.register_replica("r0", "http://r0", token, capacity=1000)
        await store.transition(
            "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="i", publish=True
        )
        ids = [f"b{i}" for i in range(400)]
        await asyncio.gather(*(store.admit(i, "r0") for i in ids))
        gone = await store.renew({i: 30.0 for i in ids})
        assert gone == set()
        await asyncio.gather(*(store.release(i, "r0") for i in ids[:10]))
        assert await store.renew({i: 30.0 for i in ids}, chunk=64) == set(ids[:10])
    finally:
        await store.close()


async def test_an_exhausted_pool_is_busy_not_down(store_settings: StoreSettings) -> None:
    """Pool exhaustion is reported as StoreBusy (Redis is fine), not as Redis being down; the
    test also pins redis-py's message for it. The pool's only connection is held by a BLPOP
    that Redis reports blocked (``CLIENT LIST``) and that ends only when the test pushes."""
    settings = store_settings.model_copy(update={"max_connections": 1, "pool_timeout_s": 0.2})
    store = RedisStore.connect(settings)
    side = RedisStore.connect(store_settings)  # a second pool, to watch and to unblock
    key = "nothing-" + uuid.uuid4().hex
    try:
        hold = asyncio.create_task(store.r.blpop([key], timeout=0))
        async with asyncio.timeout(30):
            while not any(c.get("cmd") == "blpop" for c in await side.r.client_list()):
                await asyncio.sleep(0.01)
        with pytest.raises(StoreBusy, match="stayed busy") as e:
            await store.ping()
        assert e.value.code == "store_busy" and "unreachable" not in e.value.message
        await side.r.rpush(key, "x")
        await hold
        assert await store.ping()
    finally:
        await store.close()
        await side.close()


async def test_memory_is_bounded_by_design(store_settings: StoreSettings) -> None:
    """Finished bindings were kept 7 days and update records forever,
    so Redis filled up. Full records now expire after ``binding_retention_s`` (the per-generation
    counts stay), the journal is capped and only the newest update records are kept."""
    settings = store_settings.model_copy(
        update={"binding_retention_s": 0.2, "journal_maxlen": 1000, "update_records_max": 10}
    )
    store = RedisStore.connect(settings)
    try:
        token = await store.updater_lease().acquire()
        await ready_replica(store, token, capacity=500)
        for i in range(300):
            await store.admit(f"m{i}", "r0")
            await store.release(
                f"m{i}", "r0", BindingState.ABORTED if i % 3 == 0 else BindingState.FINISHED
            )
        assert await generation_outcomes(store) == {0: {"aborted": 100, "finished": 200}}
        await asyncio.sleep(0.3)
        with pytest.raises(NotFound):
            await store.binding("m0")
        assert await store.r.xlen(store.k.journal) <= 1100  # MAXLEN ~ trims in whole nodes
        for i in range(25):
            rec = UpdateRecord(
                id=f"up-{i}",
                state=UpdateState.SUCCEEDED,
                generation=i,
                label=f"g{i}",
                checkpoint="/c",
                identity_digest="w",
                created_ms=i,
            )
            await store.save_update(rec)
        kept = await store.updates(100)
        assert [u.id for u in kept] == [f"up-{i}" for i in range(24, 14, -1)]
        assert await store.r.hlen(store.k.updates) == 10
        used, _ = await store.memory()
        assert used > 0
    finally:
        await store.close()


async def test_declared_generations_are_trimmed_to_the_newest(
    store_settings: StoreSettings,
) -> None:
    """Audit finding: per-generation records were never trimmed, and every push read them all
    (0.34 s at 20k generations). Only the newest ``generation_records_max`` are kept, with
    their labels; the next number is read from the numbers alone."""
    store = RedisStore.connect(store_settings.model_copy(update={"generation_records_max": 10}))
    try:
        lease = store.updater_lease("t")
        token = await lease.acquire()
        for n in range(25):
            gen = Generation(number=n, label=f"step-{n}")
            ident = WeightIdentity(manifest_digest="m", checkpoint_uri=f"/c/{n}")
            await store.declare_generation(GenerationRecord(generation=gen, identity=ident), token)
        numbers = [r.generation.number for r in await store.generation_records()]
        assert numbers == [0, *range(15, 25)]  # and g0's: a LoRA pool's base
        assert await store.newest_declared() == 24
        assert await store.label_owner("step-14") is None
        assert await store.label_owner("step-15") == 15
    finally:
        await store.close()


async def test_a_cancellation_during_a_call_always_ends_the_calling_loop(store: RedisStore) -> None:
    """A loop that retries store errors (as the lease keeper and the updater's record watcher
    do) ends when cancelled, wherever in a Redis call the cancellation lands. Without the seam's
    check, Python 3.11's ``asyncio.wait_for`` around redis-py's socket write returned normally
    under about two cancellations in three here, the loop ran on, and an updater's ``stop()``
    that awaited it never returned."""
    outcomes: list[str] = []
    for steps in range(40):  # the cancellation lands `steps` loop iterations into the calls

        async def retrying() -> str:
            for _ in range(100):
                with contextlib.suppress(StoreError):
                    await store.latest()
            return "ran on"

        task = asyncio.create_task(retrying())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            outcomes.append(await task)
        except asyncio.CancelledError:
            outcomes.append("cancelled")
    assert outcomes == ["cancelled"] * 40, outcomes
