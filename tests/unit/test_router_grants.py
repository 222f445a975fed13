"""Capacity grants end to end (router app, real Redis, the vLLM stand-in) and in the store:
no Redis call on a one-request rollout's path, a drain that waits for grants, an abort that
cuts what runs under them, a grant that lives on its router's registration."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pool.errors import AdmissionRefused, StoreConflict
from pool.store import RedisStore
from pool.types import BindingState, Generation, ReplicaRecord, ReplicaState
from router.keys import GRANTS, GUARD, STORE
from testkit.harness import publish_ready, router_client
from testkit.standin import StandinReplica
from tests.helpers import begin_drain, generating, generation_outcomes, taking, until
from tests.unit.test_router_upstream import settings

S = ReplicaState


async def record(store: RedisStore, rid: str) -> ReplicaRecord:
    return await store.replica(rid)


async def granted(store: RedisStore, rid: str = "r0") -> int:
    return (await store.replica(rid)).granted


def store_calls_on_the_path(store: RedisStore) -> list[str]:
    """Patch ``store`` so every Redis call made from a request handler (router/proxy.py on
    its stack) is listed in the returned list."""
    seen: list[str] = []
    inner = store.call

    async def call(fn: Callable[[], Awaitable[Any]]) -> Any:
        stack = traceback.extract_stack()
        if any(f.filename.endswith("router/proxy.py") for f in stack):
            seen.append(" <- ".join(f.name for f in stack[-6:]))
        return await inner(fn)

    store.call = call  # type: ignore[method-assign]
    return seen


async def test_a_rollout_under_a_grant_makes_no_redis_call_before_its_answer(
    upstream: tuple[StandinReplica, str], store_settings: Any, store: RedisStore
) -> None:
    _, url = upstream
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        await until(lambda: _positive(granted(store)))  # held in advance by the keeper
        calls = store_calls_on_the_path(c.server.app[STORE])
        ids = []
        for stream in (False, True, False):
            body = {"model": "rolloutpool", "prompt": "p", "max_tokens": 2, "stream": stream}
            r = await c.post("/v1/completions", json=body)
            assert r.status == 200, await r.text()
            await r.read()
            ids.append(r.headers["X-Rollout-Id"])
        assert calls == []
        for rid in ids:  # the records, written after delivery (the GET flushes them first)
            r = await c.get(f"/v1/rollouts/{rid}")
            doc = await r.json()
            assert r.status == 200 and doc["state"] == "finished" and doc["replica_id"] == "r0"
        outcomes = await generation_outcomes(store)
        assert outcomes[0]["finished"] == 3 and (await store.generation_admissions())[0] == 3
    assert await granted(store) == 0  # returned when the router stopped


async def _positive(n: Awaitable[int]) -> bool:
    return await n > 0


async def test_a_drain_waits_for_the_grant_until_its_request_was_delivered(
    upstream: tuple[StandinReplica, str], store_settings: Any, store: RedisStore
) -> None:
    """DRAINING closes the grant at once (the change feed), the request under it finishes and
    is delivered, then the grant is returned; QUIESCED is refused until then (I2)."""
    replica, url = upstream
    taking(replica, 0.5)
    await publish_ready(store, [("r0", url)])
    lease = store.updater_lease("u")
    token = await lease.acquire()
    async with router_client(settings(), store_settings) as c:
        await until(lambda: _positive(granted(store)))
        call = asyncio.create_task(c.post("/v1/completions", json={"prompt": "p"}))
        await generating(replica)
        await begin_drain(store, "r0", token, Generation(number=1, label="g1"), "wid:1")
        book = c.server.app[GRANTS]
        await until(lambda: _true(not book.grants["r0"].open))
        assert await granted(store) > 0
        with pytest.raises(StoreConflict):
            await store.transition("r0", token, S.DRAINING, S.QUIESCED)
        r = await call
        assert r.status == 200, await r.text()  # delivered: the grant held, nothing changed
        await until(lambda: _zero(granted(store)))
        await store.transition("r0", token, S.DRAINING, S.QUIESCED)
        r = await c.get(f"/v1/rollouts/{r.headers['X-Rollout-Id']}")
        assert (await r.json())["state"] == "finished"


async def _true(x: bool) -> bool:
    return x


async def _zero(n: Awaitable[int]) -> bool:
    return await n == 0


async def test_an_abort_cuts_what_runs_under_the_grant(
    upstream: tuple[StandinReplica, str], store_settings: Any, store: RedisStore
) -> None:
    """The updater's abort at a drain deadline (or a taint): the router hears it on the change
    feed, cuts the request (503 binding_lost, upstream disconnected), records it aborted with
    the reason and returns the grant."""
    replica, url = upstream
    taking(replica, 30.0)
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        await until(lambda: _positive(granted(store)))
        call = asyncio.create_task(c.post("/v1/completions", json={"prompt": "p"}))
        (generation,) = await generating(replica)
        assert await store.abort_active("r0", "drain deadline") == []  # no binding: a grant
        r = await asyncio.wait_for(call, 10)
        assert r.status == 503
        err = (await r.json())["error"]
        assert err["code"] == "binding_lost" and "drain deadline" in err["message"]
        await until(lambda: _true(generation.finish_reason == "abort"))  # the client went away
        doc = await (await c.get(f"/v1/rollouts/{r.headers['X-Rollout-Id']}")).json()
        assert doc["state"] == "aborted" and "drain deadline" in doc["reason"]
        await until(lambda: _zero(granted(store)))
        with pytest.raises(AdmissionRefused) as e:  # no new grant until READY again
            await store.grants.grant(c.server.app[GRANTS].router_id, "r0", 1, max_staleness=0)
        assert e.value.reason == "aborted"


async def test_a_grant_lives_on_its_routers_registration(store: RedisStore) -> None:
    """GRANT checks I1 and capacity (bindings and every live router's slots); a grant counts as
    active for QUIESCED; a dead router's grant is reclaimed once its registration expired."""
    await publish_ready(store, [("r0", "http://x")], capacity=4)
    token = await store.updater_lease("u").acquire()
    with pytest.raises(AdmissionRefused) as e:
        await store.grants.grant("ra", "r0", 3, max_staleness=0)
    assert e.value.reason == "unregistered"
    await store.failover.heartbeat("ra", 1, 60)
    await store.failover.heartbeat("rb", 1, 60)
    g = await store.grants.grant("ra", "r0", 3, max_staleness=0)
    assert (g.slots, g.generation, g.label) == (3, 0, "g0")
    assert (await store.grants.grant("rb", "r0", 3, max_staleness=0)).slots == 1  # what is free
    with pytest.raises(AdmissionRefused) as e:
        await store.admit("s1", "r0", session=True)
    assert e.value.reason == "at_capacity"
    assert (await store.replica("r0")).granted == 4
    await begin_drain(store, "r0", token, Generation(number=1, label="g1"), "wid:1")
    with pytest.raises(AdmissionRefused) as e:
        await store.grants.grant("rb", "r0", 2, max_staleness=0)
    assert e.value.reason == "not_ready"
    await store.grants.give_back("rb", "r0")
    with pytest.raises(StoreConflict):
        await store.transition("r0", token, S.DRAINING, S.QUIESCED)

    # ra's last heartbeat (the router then dies): its registration lapses by its TTL, as when
    # a router stops heartbeating (a TTL short from the start lapsed before the checks above
    # on a stalled test process)
    await store.failover.heartbeat("ra", 1, 0.001)

    async def ra_expired() -> bool:
        secs, usecs = await store.r.time()
        exp = await store.r.zscore(store.k.routers, "ra")
        return exp is None or exp <= int(secs) * 1000 + int(usecs) // 1000

    await until(ra_expired)
    assert (await store.replica("r0")).granted == 0
    await store.transition("r0", token, S.DRAINING, S.QUIESCED)  # reclaimed by the CAS itself
    assert await store.r.hlen(store.k.granted("r0")) == 0


async def test_records_are_written_once_with_the_generation_counts(store: RedisStore) -> None:
    from pool.store.grants import FinalRecord

    recs = [
        FinalRecord("a", "r0", 3, "g3", "wid", BindingState.FINISHED, "", 5, 7, 1, "key:x"),
        FinalRecord("b", "r0", 3, "g3", "wid", BindingState.ABORTED, "cut", 5, 0, 1),
    ]
    assert await store.grants.record(recs) == 2
    assert await store.grants.record(recs) == 0  # a retried batch changes nothing
    a = await store.binding("a")
    assert (a.state, a.generation, a.completion_tokens, a.client) == (
        BindingState.FINISHED,
        3,
        7,
        "key:x",
    )
    assert (await store.binding("b")).reason == "cut"
    assert await store.generation_admissions() == {3: 2}
    assert await generation_outcomes(store) == {3: {"finished": 1, "aborted": 1}}


async def test_a_router_that_was_frozen_cuts_what_ran_under_its_grants(
    upstream: tuple[StandinReplica, str], store_settings: Any, store: RedisStore
) -> None:
    """Resumed after a freeze longer than half its registration's TTL, a router's next
    heartbeat succeeds, but the grants may have been reclaimed meanwhile (and the replica
    updated under a request not yet sent): everything under them is cut, none of it is
    delivered, and they are forgotten before the new registration counts."""
    replica, url = upstream
    taking(replica, 30.0)
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        await until(lambda: _positive(granted(store)))
        call = asyncio.create_task(c.post("/v1/completions", json={"prompt": "p"}))
        await generating(replica)
        book, guard = c.server.app[GRANTS], c.server.app[GUARD]
        assert book.registered_at is not None
        book.registered_at -= store.settings.failover_grace_s  # as if frozen that long
        assert not book.live()
        await guard.tick()
        r = await asyncio.wait_for(call, 10)
        assert r.status == 503 and (await r.json())["error"]["code"] == "binding_lost"
        doc = await (await c.get(f"/v1/rollouts/{r.headers['X-Rollout-Id']}")).json()
        assert doc["state"] == "aborted" and "may have lapsed" in doc["reason"]
        assert book.live()
        assert "r0" not in book.grants or book.grants["r0"].in_use == 0


async def test_a_grant_being_returned_never_admits_again() -> None:
    """The keeper returns a closed, idle grant; if the view says READY on its generation again
    while the return is in flight (an update cancelled), no slot is taken from it: Redis no
    longer counts it, so nothing may run under it."""
    from pool.store.grants import Grant
    from router.grants import GrantBook, LocalGrant

    returning, release = asyncio.Event(), asyncio.Event()

    class Grants:
        async def give_back(self, router_id: str, replica_id: str) -> None:
            returning.set()
            await release.wait()

        async def grant(self, *args: Any, **kw: Any) -> Grant:
            raise AdmissionRefused("at_capacity")

    class Store:
        grants = Grants()

    book = GrantBook(Store(), "r", slots=4, max_staleness=0, grace_s=10)  # type: ignore[arg-type]
    book.epoch, book.registered_at = 1, time.monotonic()
    ready = ReplicaRecord(
        replica_id="r0", url="u", state=S.READY, generation=0, label="g0", capacity=8
    )
    latest = Generation(number=0, label="g0")
    book.grants["r0"] = LocalGrant(Grant("r0", 4, 0, "g0", "wid"))
    book.on_view({"r0": ready}, latest)
    assert book.take("r0", 0) is not None  # open
    book.put(book.grants["r0"], "x")
    book.on_view({"r0": ready.model_copy(update={"state": S.DRAINING})}, latest)
    tend = asyncio.create_task(book._tend())
    await returning.wait()
    book.on_view({"r0": ready}, latest)  # READY again while the return is in flight
    assert book.take("r0", 0) is None
    release.set()
    await tend
    assert "r0" not in book.grants


async def test_a_refused_grow_does_not_hold_back_the_returns(store: RedisStore) -> None:
    """The keeper's round returns every closed, idle grant even when growing another is
    refused (at capacity): a grant left behind would hold its replica's drain."""
    from router.grants import GrantBook

    await publish_ready(store, [("r0", "http://a"), ("r1", "http://b")], capacity=4)
    for router in ("rk", "other"):
        await store.failover.heartbeat(router, 1, 60)
    await store.grants.grant("other", "r0", 1, max_staleness=0)  # r0: 3 slots left
    book = GrantBook(store, "rk", slots=3, max_staleness=0, grace_s=120)
    book.epoch, book.registered_at = 1, time.monotonic()
    latest = Generation(number=0, label="g0")
    book.on_view({r.replica_id: r for r in await store.replicas()}, latest)
    await book._tend()  # a grant of 3 on each
    assert {rid: lg.grant.slots for rid, lg in book.grants.items()} == {"r0": 3, "r1": 3}
    for _ in range(3):
        assert book.take("r0", 0) is not None  # r0 full: the keeper will try to grow it
    token = await store.updater_lease("u").acquire()
    await begin_drain(store, "r1", token, Generation(number=1, label="g1"), "wid:1")
    book.on_view({r.replica_id: r for r in await store.replicas()}, latest)
    await book._tend()  # growing r0 is refused (at capacity); r1's grant is returned anyway
    assert "r1" not in book.grants and (await store.replica("r1")).granted == 0


async def test_two_grows_at_once_never_replace_a_grant_a_request_runs_under(
    store: RedisStore,
) -> None:
    """Two requests find no free slot on a replica whose generation moved on (a LoRA pool's
    replicas move with no drain) and grow its grant at once. The grow that answers last must
    not replace the fresh grant the first one made and a request took: that request's
    settlement would find its grant gone and withhold its answer (503 binding_ended)."""
    from pool.store.grants import Grant
    from router.bindings import Settled
    from router.grants import GrantBook, LocalGrant

    g1 = Generation(number=1, label="g1")
    await publish_ready(store, [("r0", "http://a")], generation=g1, capacity=16)
    await store.failover.heartbeat("rk", 1, 60)
    book = GrantBook(store, "rk", slots=2, max_staleness=0, grace_s=120)
    book.epoch, book.registered_at = 1, time.monotonic()
    book.grants["r0"] = LocalGrant(Grant("r0", 2, 0, "g0", "wid"))  # held when r0 was on g0
    book.on_view({r.replica_id: r for r in await store.replicas()}, g1)  # closes it

    real, calls, first_may_answer = store.grants.grant, [], asyncio.Event()

    async def grant(*args: Any, **kw: Any) -> Grant:
        calls.append(len(calls))
        mine = calls[-1]
        out = await real(*args, **kw)
        if mine == 0:  # the first grow's answer arrives after the second one's request ran
            await first_may_answer.wait()
        return out

    store.grants.grant = grant  # type: ignore[method-assign]

    async def grow_and_take() -> LocalGrant | None:
        await until(lambda: _true(len(calls) == 1))  # the other grow is under way
        await book.grow("r0")
        lg = book.take("r0", 1)
        first_may_answer.set()
        return lg

    _, taken = await asyncio.gather(book.grow("r0"), grow_and_take())
    assert taken is not None
    assert book.grants["r0"] is taken
    assert book.settle(taken, "ro-1") is Settled.CONFIRMED


async def test_a_grant_given_again_after_the_replica_moved_on_holds_the_new_generation(
    store: RedisStore,
) -> None:
    """A LoRA pool's replica moves from g0 to g1 with no drain while a router holds a grant
    given on g0. Once nothing runs under it, the router's next grant must be recorded on g1:
    that is what a retire of an old adapter reads (the holds). A grant grown over the g0 entry
    kept g0 there, so g1's adapter could be unloaded under the requests the grant admitted."""
    from router.grants import GrantBook

    await publish_ready(store, [("r0", "http://a")], capacity=16)
    await store.failover.heartbeat("rk", 1, 60)
    book = GrantBook(store, "rk", slots=2, max_staleness=0, grace_s=120)
    book.epoch, book.registered_at = 1, time.monotonic()
    book.on_view(
        {r.replica_id: r for r in await store.replicas()}, Generation(number=0, label="g0")
    )
    await book._tend()  # a grant on g0
    assert await store.adapters.holds("r0") == {0}
    g1 = Generation(number=1, label="g1")
    token = await store.updater_lease("u").acquire()
    await store.transition(
        "r0", token, S.READY, S.READY, generation=g1, identity_digest="wid:1", publish=True
    )
    book.on_view({r.replica_id: r for r in await store.replicas()}, g1)
    await book.grow("r0")
    lg = book.take("r0", 1)
    assert lg is not None and lg.grant.generation == 1
    assert await store.adapters.holds("r0") == {1}
