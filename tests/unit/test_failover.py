"""Writes a Redis failover loses, on a real Sentinel group (a primary, a replica and a sentinel
started here), and what keeps them from breaking the contract.

A write is lost for real: the replica is SIGSTOPped and the primary drops its replication link
(``CLIENT KILL TYPE replica``: what was sent before stays in the replica's socket, nothing after
is sent), the write lands on the primary only, the primary is SIGKILLed, the replica resumes and
``SENTINEL FAILOVER`` promotes it. Each test pins
one hole (and fails without its fix):

* a lost ADMIT leaves a request running on a replica whose active count at the new primary is
  0; the updater's gate must not let a transfer start until the router's failover guard has cut
  that request (and recorded the rollout as aborted with the reason);
* a lost ``INCR`` of the fencing counter (and a lost lease key) lets a new updater draw the very
  counter value an old one holds; the epoch makes its token greater, and the old one can no
  longer write or renew;
* a binding that ends under a running request (here: released by someone else) gets the
  request cut at the next renewal, instead of it running on for nobody.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from pool.errors import NotFound, StaleFencingToken, StoreError
from pool.metrics import RouterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore, token_epoch
from pool.store.feed import PoolWatch
from pool.types import BindingState, Generation, ReplicaState
from router.bindings import Bindings, Held
from router.errors import BindingEnded
from router.failover import FailoverGuard, cuttable
from router.grants import GrantBook, LocalGrant
from router.provenance import RolloutInfo
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client
from testkit.redis_ha import SentinelGroup, command
from testkit.standin import StandinReplica
from tests.helpers import aborted, active_rollouts, begin_drain, generating, taking
from tests.unit.test_router_upstream import sse
from updater.failover import EpochGate

S = ReplicaState
G0 = Generation(number=0, label="g0")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    g = SentinelGroup(
        Path(tmp_path_factory.mktemp("sentinel")),
        replicas=1,
        sentinels=1,
        down_after_ms=60_000,  # failovers here are forced, never detected
        min_replicas_to_write=0,  # one replica: the promoted primary has none at first
    )
    yield g.start()
    g.stop()


@pytest.fixture
async def ha_store(group: SentinelGroup) -> AsyncIterator[RedisStore]:
    # a router registration (failover_grace_s) that cannot lapse while a failover is staged,
    # however loaded the machine: the tests stop heartbeating across lose(). The store only
    # talks to a primary that is alive or killed (a SIGSTOPped node is never its primary), so
    # the socket timeout only bounds a late answer: under stress-ng one took longer than 0.5 s.
    settings = group.store_settings(
        f"f{uuid.uuid4().hex[:8]}", wait_replicas=0, socket_timeout_s=10, failover_grace_s=600
    )
    store = RedisStore.connect(settings)
    yield store
    await store.close()


async def until_reachable(store: RedisStore, primary: int) -> None:
    """Wait until the store's calls land on ``primary`` (idle connections to the dead primary
    fail once and reconnect through the sentinels)."""
    async with asyncio.timeout(60):  # a bound for a store that never follows, not a guess
        while True:
            try:
                e = await store.failover.epoch()
                await store.ping()
                if e.primary.endswith(f":{primary}"):
                    return
            except StoreError:
                pass
            await asyncio.sleep(0.05)


async def lose(group: SentinelGroup, store: RedisStore, write: Any) -> Any:
    """Run ``write`` on the primary alone, then fail over to a replica that never got it."""
    old = group.primary_port()
    replica = next(n for n in group.nodes if n.port != old)
    await asyncio.to_thread(group.wait_caught_up, old)  # everything before the write is there
    replica.signal(signal.SIGSTOP)
    try:
        assert command(old, "CLIENT", "KILL", "TYPE", "replica") == "1"
        result = await write()
    finally:
        group.node(old).signal(signal.SIGKILL)
        replica.signal(signal.SIGCONT)
    await asyncio.to_thread(group.force_failover)
    new, _ = await asyncio.to_thread(group.wait_promoted, old)
    await until_reachable(store, new)
    await asyncio.to_thread(group.restart, old)  # back as a replica of the new primary
    await asyncio.to_thread(group.wait_replicas_synced, new, 1)
    await asyncio.to_thread(group.wait_sentinels_ready)
    return result


async def ready_replica(store: RedisStore) -> int:
    token = await store.updater_lease("setup").acquire()
    await store.register_replica("r0", "http://r0", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="i", publish=True
    )
    return token


async def test_a_lost_admit_gets_its_request_cut_before_any_transfer(
    group: SentinelGroup, ha_store: RedisStore
) -> None:
    store = ha_store
    await ready_replica(store)
    bindings = Bindings(store, RouterMetrics.create(CollectorRegistry()))
    guard = FailoverGuard(store, bindings)
    await guard.tick()  # registered, epoch verified
    epoch0 = bindings.epoch
    assert epoch0 is not None
    adm = await lose(group, store, lambda: store.admit("ro-lost", "r0"))
    running = asyncio.Event()

    async def request() -> None:  # the rollout's request, still running on r0
        with bindings.renewing("ro-lost", 30, RolloutInfo.of_admission(adm), epoch=epoch0):
            running.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(request())
    await running.wait()
    # the hole: at the new primary, r0 has no active binding while the request runs
    assert (await store.replica("r0")).active == 0
    gate = EpochGate(store, poll_s=0.02)
    with pytest.raises(TimeoutError):  # no transfer may start: the router has not verified
        await asyncio.wait_for(gate.settled(), 0.5)
    for _ in range(600):  # the router sees the new epoch: once settled, verifies, cuts, reports
        await guard.tick()
        if bindings.epoch != epoch0:
            break
        await asyncio.sleep(0.1)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)  # bounds, not timings: on a loaded machine too
    epoch = await asyncio.wait_for(gate.settled(), 30)
    assert epoch.number > epoch0 and bindings.epoch == epoch.number
    b = await store.binding("ro-lost")
    assert b.state is BindingState.ABORTED and "lost in a Redis failover" in b.reason
    assert guard.lost == 1 and guard.cut == 1


async def test_a_lost_fencing_increment_cannot_give_two_updaters_one_token(
    group: SentinelGroup, ha_store: RedisStore
) -> None:
    store = ha_store
    await ready_replica(store)
    await store.updater_lease("setup").release()
    await store.r.delete(store.k.lease)
    old = store.updater_lease("old")
    t_old = await lose(group, store, old.acquire)  # its INCR and its lease key are lost
    new = store.updater_lease("new")
    t_new = await new.acquire(blocking_timeout_s=1)
    # the hole: the counter handed out the same value again ...
    assert t_new & 0xFFFFFFFF == t_old & 0xFFFFFFFF
    # ... but the epoch orders the tokens, and only the new one writes
    assert t_new > t_old and token_epoch(t_new) > token_epoch(t_old)
    with pytest.raises(StaleFencingToken):
        await begin_drain(store, "r0", t_old, Generation(number=1, label="g1"), "i1")
    with pytest.raises(StaleFencingToken):
        await old.extend()
    await begin_drain(store, "r0", t_new, Generation(number=1, label="g1"), "i1")


async def test_a_renewal_that_finds_the_binding_gone_cuts_the_request(
    store_settings: StoreSettings,
) -> None:
    store = RedisStore.connect(store_settings)
    try:
        await ready_replica(store)
        adm = await store.admit("ro-1", "r0", lease_s=0.3)
        bindings = Bindings(store, RouterMetrics.create(CollectorRegistry()))
        info = RolloutInfo.of_admission(adm)
        started = asyncio.Event()

        async def handler() -> Any:
            with bindings.renewing("ro-1", 0.3, info) as held:

                async def run() -> Any:
                    started.set()
                    await asyncio.sleep(60)  # the upstream generation

                return await cuttable(make_mocked_request("POST", "/v1/completions"), held, run())

        task = asyncio.create_task(handler())
        await started.wait()
        await store.release("ro-1", "r0", BindingState.ABORTED, reason="drain ended")
        stop = asyncio.Event()
        renewer = asyncio.create_task(bindings.renew_forever(0.05, stop))
        with pytest.raises(BindingEnded) as e:
            await asyncio.wait_for(task, 5)
        stop.set()
        await renewer
        assert e.value.status == 503 and e.value.code == "binding_lost"
        assert "ended while the request ran" in e.value.message
    finally:
        await store.close()


async def test_a_rollout_whose_admission_and_end_a_failover_lost_gets_its_record_back(
    group: SentinelGroup, ha_store: RedisStore
) -> None:
    """The client has its answer (the old primary confirmed the end), but the new primary has
    no record of the rollout: the router's guard writes it again, as it ended."""
    store = ha_store
    await ready_replica(store)
    bindings = Bindings(store, RouterMetrics.create(CollectorRegistry()))
    guard = FailoverGuard(store, bindings)
    await guard.tick()
    epoch0 = bindings.epoch

    async def rollout() -> None:
        adm = await store.admit("ro-done", "r0")
        with bindings.renewing("ro-done", 30, RolloutInfo.of_admission(adm)):
            verdict = await bindings.end("ro-done", "r0", BindingState.FINISHED, "", 3, 5)
        assert verdict.value == "confirmed"

    await lose(group, store, rollout)
    with pytest.raises(NotFound):
        await store.binding("ro-done")  # the hole: a delivered rollout without a record
    for _ in range(600):
        await guard.tick()
        if bindings.epoch != epoch0:
            break
        await asyncio.sleep(0.1)
    b = await store.binding("ro-done")
    assert b.state is BindingState.FINISHED and b.completion_tokens == 5
    assert guard.restored == 1


async def test_a_cut_request_ends_its_binding_with_the_cut_reason(
    store_settings: StoreSettings,
) -> None:
    """A cut cancels the request; its release must say why it was cut (not 'client
    disconnected', which is what a cancelled request otherwise records)."""
    store = RedisStore.connect(store_settings)
    try:
        await ready_replica(store)
        adm = await store.admit("ro-2", "r0")
        bindings = Bindings(store, RouterMetrics.create(CollectorRegistry()))
        started = asyncio.Event()

        async def handler() -> Any:
            with bindings.renewing("ro-2", 30, RolloutInfo.of_admission(adm)) as held:

                async def run() -> Any:
                    try:
                        started.set()
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:  # what run_settled does when cancelled
                        await bindings.release("ro-2", "r0", BindingState.ABORTED, "client gone")
                        raise

                return await cuttable(make_mocked_request("POST", "/v1/completions"), held, run())

        task = asyncio.create_task(handler())
        await started.wait()
        assert bindings.cut("ro-2", "this router could not reach Redis for 5.0 s") == 1
        with pytest.raises(BindingEnded):
            await task
        b = await store.binding("ro-2")
        assert b.state is BindingState.ABORTED and b.reason.startswith("this router could not")
    finally:
        await store.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_whose_binding_ends_under_it_is_cut_through_the_router(
    upstream: tuple[StandinReplica, str],
    store_settings: StoreSettings,
    store: RedisStore,
    stream: bool,
) -> None:
    """The router app end to end (the vLLM stand-in, generating slowly): the binding is
    ended from outside (as the updater does at a drain deadline); the next renewal cuts the
    request, the upstream sees the disconnect, and the client gets 503 binding_lost (a stream:
    an SSE error event) with the binding's reason."""
    replica, url = upstream
    taking(replica, 30.0, tokens=400)
    await publish_ready(store, [("r0", url)])
    rs = RouterSettings(admission_wait_s=1.0, request_lease_s=0.6, grants=False)
    async with router_client(rs, store_settings) as c:
        body = {"model": "rolloutpool", "prompt": "hi", "max_tokens": 400, "stream": stream}
        call = asyncio.create_task(c.post("/v1/completions", json=body))
        (generation,) = await generating(replica)
        (rid,) = await active_rollouts(store, "r0")
        await store.release(rid, "r0", BindingState.ABORTED, reason="drain ended")
        r = await asyncio.wait_for(call, 10)
        if stream:
            assert r.status == 200
            events = await sse(r)
            err = events[-1]["error"]
        else:
            assert r.status == 503
            err = (await r.json())["error"]
        assert err["code"] == "binding_lost" and err["rollout"]["id"] == rid
        await aborted(generation)  # the upstream saw the disconnect
    b = await store.binding(rid)
    assert b.state is BindingState.ABORTED and b.reason == "drain ended"


async def test_a_grant_lost_in_a_failover_gets_its_requests_cut_before_any_transfer(
    group: SentinelGroup, ha_store: RedisStore
) -> None:
    """The grant's counterpart of the lost ADMIT: a router's grant the failover lost no longer
    counts at the new primary while a request runs under it; the gate holds every transfer
    until the router has verified the new epoch, and verifying finds the grant gone, drops it
    and cuts the request."""
    store = ha_store
    await ready_replica(store)
    bindings = Bindings(store, RouterMetrics.create(CollectorRegistry()))
    guard = FailoverGuard(store, bindings)
    book = GrantBook(store, guard.router_id, slots=2, max_staleness=0, grace_s=20)
    guard.attach(PoolWatch(store), book)
    await guard.tick()  # registered, epoch verified
    epoch0 = bindings.epoch
    g = await lose(
        group, store, lambda: store.grants.grant(guard.router_id, "r0", 2, max_staleness=0)
    )
    lg = book.grants["r0"] = LocalGrant(g, epoch=epoch0)
    running = asyncio.Event()

    async def request() -> None:  # a one-request rollout under the lost grant
        task = asyncio.current_task()
        assert task is not None
        held = Held(0.0, 0.0)
        held.tasks.add(task)
        book.run(lg, "ro-under-grant", held)
        running.set()
        await asyncio.sleep(60)

    task = asyncio.create_task(request())
    await running.wait()
    assert (await store.replica("r0")).granted == 0  # the hole, at the new primary
    gate = EpochGate(store, poll_s=0.02)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(gate.settled(), 0.5)
    for _ in range(600):  # bounds, not timings: a loaded machine fails over slowly
        await guard.tick()
        if bindings.epoch != epoch0:
            break
        await asyncio.sleep(0.1)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert "r0" not in book.grants and lg.aborted is not None and "lost" in lg.aborted
    epoch = await asyncio.wait_for(gate.settled(), 30)
    assert epoch.number > epoch0 and guard.cut == 1
