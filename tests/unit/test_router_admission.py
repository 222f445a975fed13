"""Admission: constraints, candidate ordering (pure) and the 409/503 outcomes over HTTP with a
real Redis and no vLLM (replica URLs point at closed ports)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from pool.metrics import RouterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.store.feed import PoolWatch
from pool.types import BindingState, Generation, ReplicaRecord, ReplicaState
from pool.web import BadRequest
from router.admission import Admitter, PoolSnapshot, ReplicaView, affinity_key, candidates
from router.bindings import Bindings
from router.constraints import Constraints, GenerationUnsatisfiable, check_satisfiable
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client
from tests.helpers import until

DEAD = "http://127.0.0.1:1"  # connection refused
BODY = {"model": "rolloutpool", "prompt": "hello", "max_tokens": 1}


def rec(
    rid: str, active: int = 0, generation: int = 0, state: str = "READY", capacity: int = 64
) -> ReplicaRecord:
    return ReplicaRecord(
        replica_id=rid,
        url=f"http://{rid}",
        state=ReplicaState(state),
        generation=generation,
        label=f"g{generation}",
        active=active,
        capacity=capacity,
    )


def snap(*replicas: ReplicaRecord, latest: int | None = 0) -> PoolSnapshot:
    g = None if latest is None else Generation(number=latest, label=f"g{latest}")
    return PoolSnapshot(tuple(replicas), g, time.monotonic(), {})


def view() -> ReplicaView:
    return ReplicaView(store=None, ttl_s=1.0)  # type: ignore[arg-type]  # pure use only


def test_constraints_from_headers_and_body() -> None:
    c = Constraints.from_headers({"X-Rollout-Min-Generation": "2"})
    assert c == Constraints(min_generation=2)
    merged = c.merge(Constraints.parse({"min_generation": 3, "generation": 4}, "body"))
    assert merged == Constraints(min_generation=3, generation=4)
    with pytest.raises(BadRequest):
        Constraints.from_headers({"X-Rollout-Generation": "latest"})
    with pytest.raises(BadRequest):
        Constraints.parse({"generation": 1, "extra": True}, "body")
    # header and body naming different exact generations: no generation satisfies both (409,
    # documented; it was a 400 that a schema-valid request could not expect)
    with pytest.raises(GenerationUnsatisfiable) as e:
        Constraints(generation=1).merge(Constraints(generation=2))
    assert e.value.status == 409
    assert Constraints(min_generation=2).allows(3) and not Constraints(generation=2).allows(3)


@pytest.mark.parametrize(
    "body",
    [{"generation": False}, {"min_generation": True}, {"generation": "3"}, {"generation": 1.5}],
)
def test_constraints_in_a_body_are_strictly_typed(body: dict[str, object]) -> None:
    # pins: {"generation": false} was taken as generation 0
    with pytest.raises(BadRequest):
        Constraints.parse(body, "body")
    assert Constraints.parse({"generation": 2.0}, "body") == Constraints(generation=2)


@pytest.mark.parametrize(
    "c,staleness",
    [
        (Constraints(generation=6), 0),  # newer than published
        (Constraints(generation=3), 1),  # older than the admissible window [4, 5]
        (Constraints(min_generation=6), 3),  # nothing published meets it
        (Constraints(min_generation=5, generation=4), 2),  # contradictory
    ],
)
def test_unsatisfiable_constraints(c: Constraints, staleness: int) -> None:
    with pytest.raises(GenerationUnsatisfiable) as e:
        check_satisfiable(Generation(number=5, label="g5"), c, staleness)
    assert e.value.status == 409 and e.value.context["latest"] == 5


def test_satisfiable_constraints() -> None:
    g5 = Generation(number=5, label="g5")
    check_satisfiable(g5, Constraints(generation=5), 0)
    check_satisfiable(g5, Constraints(generation=3, min_generation=3), 2)
    check_satisfiable(None, Constraints(generation=9), 0)  # nothing published: wait instead


def test_candidates_prefer_fewest_active_then_affinity() -> None:
    v = view()
    s = snap(
        rec("a", active=3),
        rec("b", active=1),
        rec("c", active=1),
        rec("d", state="DRAINING"),
        rec("e", generation=-0, state="TAINTED"),
        rec("f", active=64),
    )
    order = [r.replica_id for r in candidates(v, s, Constraints(), 0, b"prompt")]
    assert order[2] == "a" and set(order[:2]) == {"b", "c"} and len(order) == 3
    # the same key always breaks the tie the same way; different keys spread
    assert order == [r.replica_id for r in candidates(v, s, Constraints(), 0, b"prompt")]
    firsts = Counter(
        candidates(v, snap(rec("a"), rec("b"), rec("c")), Constraints(), 0, f"p{i}".encode())[
            0
        ].replica_id
        for i in range(300)
    )
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 50


def test_candidates_respect_staleness_and_constraints() -> None:
    v = view()
    s = snap(rec("old", generation=3), rec("mid", generation=4), rec("new", generation=5), latest=5)

    def ids(c: Constraints, k: int) -> set[str]:
        return {r.replica_id for r in candidates(v, s, c, k, b"")}

    assert ids(Constraints(), 0) == {"new"}
    assert ids(Constraints(), 1) == {"mid", "new"}
    assert ids(Constraints(generation=4), 2) == {"mid"}
    assert ids(Constraints(min_generation=4), 2) == {"mid", "new"}
    assert candidates(v, snap(rec("a"), latest=None), Constraints(), 0, b"") == []


def test_own_inflight_counts_steer_load() -> None:
    v = view()
    s = snap(rec("a"), rec("b"))
    v.started("a")
    v.started("a")
    assert candidates(v, s, Constraints(), 0, b"k")[0].replica_id == "b"
    v.finished("a")
    v.finished("a")
    assert v.own == Counter()


def admitter(store: RedisStore, ttl_s: float) -> Admitter:
    metrics = RouterMetrics.create(CollectorRegistry())
    bindings = Bindings(store, metrics)
    bindings.epoch = 0  # as if the failover guard had verified an epoch (it admits only then)
    return Admitter(
        store,
        ReplicaView(store, ttl_s),
        bindings,
        metrics,
        max_staleness=0,
        wait_s=1.0,
        retry_after_s=1,
    )


async def test_a_burst_of_admissions_spreads_over_the_replicas(store: RedisStore) -> None:
    """20 concurrent admissions with the same prefix key read the same cached counts; each
    choice is counted before its ADMIT is awaited, so they alternate instead of all landing on
    the replica the key prefers."""
    await publish_ready(store, [("r0", DEAD), ("r1", DEAD)])
    adm = admitter(store, ttl_s=60.0)
    burst = [
        adm.admit(f"ro-{i}", Constraints(), b"same", session=False, lease_s=30) for i in range(20)
    ]
    got = await asyncio.gather(*burst)
    per = Counter(a.replica.replica_id for a in got)
    assert per == Counter({"r0": 10, "r1": 10}), per
    snap = await adm.view.get()  # the cached read from before the burst: nothing left pending
    assert [(r.active, adm.view.load(snap, r)) for r in snap.replicas] == [(0, 0), (0, 0)]
    for a in got:
        await store.release(a.admission.rollout_id, a.replica.replica_id)


async def test_sessions_count_before_the_cached_view_sees_them(store: RedisStore) -> None:
    """Sequential session admissions within one cached view (60 s TTL) still alternate: the
    view counts its own session admissions until a later read includes them."""
    await publish_ready(store, [("r0", DEAD), ("r1", DEAD)])
    adm = admitter(store, ttl_s=60.0)
    got = [
        await adm.admit(f"ro-s{i}", Constraints(), b"", session=True, lease_s=30) for i in range(6)
    ]
    assert Counter(a.replica.replica_id for a in got) == Counter({"r0": 3, "r1": 3})
    snap = await adm.view.get(fresh=True)  # a read that includes them replaces the counts
    assert [adm.view.load(snap, r) for r in snap.replicas] == [3, 3]
    for a in got:
        await store.release(a.admission.rollout_id, a.replica.replica_id)


async def test_a_waiting_admission_is_tried_again_at_the_next_change_of_the_view(
    store: RedisStore,
) -> None:
    """No replica READY: the admission waits. Once one is READY, the change feed (a real
    ``PoolWatch`` on the store, wired as the router wires it) invalidates the view, and that
    wakes the waiting admission at once: it does not sleep out its back-off (here 30 s, so that
    only the wake-up can admit it within the test's bound)."""
    adm = admitter(store, ttl_s=60.0)
    adm.wait_s, adm.backoff_s = 120.0, (30.0, 30.0)
    watch = adm.view.watch = PoolWatch(store, on_change=lambda ids: adm.view.invalidate())
    parked = asyncio.Event()  # the admission's first round found no replica; it waits
    wait_change = adm.view.wait_change

    async def waits(timeout_s: float) -> bool:
        parked.set()
        return await wait_change(timeout_s)

    adm.view.wait_change = waits  # type: ignore[method-assign]
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(stop))
    try:

        async def subscribed() -> bool:
            return watch.read_at is not None

        await until(subscribed)
        waiting = asyncio.create_task(
            adm.admit("ro-w", Constraints(), b"", session=False, lease_s=30)
        )
        await asyncio.wait({waiting, asyncio.ensure_future(parked.wait())}, timeout=10.0,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        assert parked.is_set() and not waiting.done(), waiting
        await publish_ready(store, [("r0", DEAD)])
        got = await asyncio.wait_for(waiting, 10.0)
        assert got.replica.replica_id == "r0"
        await store.release("ro-w", "r0")
    finally:
        stop.set()
        await following


def test_affinity_key_forms() -> None:
    long = "x" * 1000
    assert affinity_key({"prompt": long}) == b"x" * 256
    assert affinity_key({"prompt": [long, "y"]}) == b"x" * 256
    assert affinity_key({"prompt": list(range(100))}) == ",".join(map(str, range(64))).encode()
    assert affinity_key({"token_ids": [1, 2]}) == b"1,2"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert affinity_key({"messages": msgs}) == b"be brief\x1ehi"
    assert affinity_key({}) == b""


def settings(**kw: Any) -> RouterSettings:
    base: dict[str, Any] = {"admission_wait_s": 0.3, "retry_after_s": 2}
    base.update(kw)
    return RouterSettings(**base)


async def _no_grant(store: RedisStore, replica_id: str) -> bool:
    return (await store.replica(replica_id)).granted == 0


async def test_no_ready_replica_is_503_after_the_wait(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    async with router_client(settings(), store_settings) as c:
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json=BODY)
        elapsed = time.monotonic() - t0
        assert r.status == 503 and r.headers["Retry-After"] == "2"
        body = await r.json()
        assert body["error"]["code"] == "no_replica_available"
        assert "no generation has been published" in body["error"]["message"]
        assert 0.3 <= elapsed < 3

        await publish_ready(store, [("r0", DEAD)])
        await store.taint("r0", "test", source="test")
        # The router hears the taint on its change feed; until then it may still admit under a
        # grant it took while r0 was READY (weights cannot change under it). Once it has heard,
        # it has returned that grant.
        await until(lambda: _no_grant(store, "r0"))
        r = await c.post("/v1/completions", json=BODY)
        assert r.status == 503
        body = await r.json()
        assert body["error"]["replicas"] == {"r0": "TAINTED"}
        r = await c.post("/v1/rollouts")
        assert r.status == 503
    assert await store.leased_rollouts() == 0


async def test_full_replica_is_503(store_settings: StoreSettings, store: RedisStore) -> None:
    await publish_ready(store, [("r0", DEAD)], capacity=1)
    await store.admit("ro-other", "r0")
    async with router_client(settings(), store_settings) as c:
        r = await c.post("/v1/completions", json=BODY)
        assert r.status == 503
        assert "spare capacity" in (await r.json())["error"]["message"]
    await store.release("ro-other", "r0")


async def test_unsatisfiable_generation_is_409(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    await publish_ready(store, [("r1", DEAD)], generation=Generation(number=1, label="g1"))
    async with router_client(settings(), store_settings) as c:
        for headers, body in [
            ({"X-Rollout-Generation": "2"}, BODY),
            ({"X-Rollout-Generation": "0"}, BODY),  # older than latest - max_staleness (0)
            ({"X-Rollout-Min-Generation": "5"}, BODY),
            ({}, {**BODY, "rollout": {"generation": 7}}),
        ]:
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status == 409, (headers, body)
            err = (await r.json())["error"]
            assert err["code"] == "generation_unsatisfiable" and err["latest"] == 1
        r = await c.post("/v1/rollouts", json={"generation": 0})
        assert r.status == 409
    assert await store.leased_rollouts() == 0


async def test_a_generation_published_a_moment_ago_is_not_unsatisfiable(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """X-Rollout-Min-Generation equal to a generation published a
    moment ago got 409 from the cached view; unsatisfiability is judged on fresh state."""
    await publish_ready(store, [("r0", DEAD)])
    async with router_client(settings(replica_view_ttl_s=60), store_settings) as c:
        r = await c.post("/v1/completions", json=BODY)  # the view is cached: g0 published
        assert r.status == 502 and r.headers["X-Rollout-Generation"] == "0"
        await publish_ready(store, [("r1", DEAD)], generation=Generation(number=1, label="g1"))
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Min-Generation": "1"})
        assert r.status == 502, await r.text()  # admitted (then the dead upstream)
        assert r.headers["X-Rollout-Generation"] == "1" and r.headers["X-Rollout-Replica"] == "r1"
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Min-Generation": "2"})
        assert r.status == 409  # still unsatisfiable on fresh state
    assert await store.leased_rollouts() == 0


async def test_admitted_then_upstream_unreachable_is_502_and_aborted(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """A real connection refusal (no fake server): the binding ends aborted, nothing leaks."""
    await publish_ready(store, [("r0", DEAD)])
    await publish_ready(store, [("r1", DEAD)], generation=Generation(number=1, label="g1"))
    async with router_client(settings(max_staleness=1), store_settings) as c:
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Generation": "0"})
        assert r.status == 502
        err = (await r.json())["error"]
        assert err["code"] == "upstream_unavailable"
        rid = r.headers["X-Rollout-Id"]
        assert r.headers["X-Rollout-Replica"] == "r0" and r.headers["X-Rollout-Generation"] == "0"
        assert err["rollout"]["id"] == rid
        r = await c.get(f"/v1/rollouts/{rid}")  # written after the answer: flushed first
        assert r.status == 200 and (await r.json())["state"] == "aborted"
        b = await store.binding(rid)
        assert b.state is BindingState.ABORTED and b.reason.startswith("upstream unavailable")
    assert [x.active for x in await store.replicas()] == [0, 0]
    assert await store.leased_rollouts() == 0
