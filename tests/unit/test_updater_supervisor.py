"""The supervisor routes recovery through the replica provider, with a real Redis store
and a provider that records its calls (the adapters run for real in tests/integration and in
tests/unit/test_providers_kubernetes.py). The engine is never reached in these paths."""

from __future__ import annotations

import asyncio
from typing import Self

import httpx

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import StoreUnavailable
from pool.evidence import ProcessIdentity
from pool.lifecycle import Lifecycle
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from rolloutpool.local.models import ensure_model
from testkit.standin import ReplicaConfig as StandinConfig
from testkit.standin import StandinFleet
from updater.cycle import CycleRunner, ReplicaHandle
from updater.providers.base import Location, PlacementError, ReplicaProvider
from updater.replicas import ManagedReplica
from updater.settings import ReplicaConfig, UpdaterSettings
from updater.supervisor import WAITING_FOR_RESTART, Supervisor
from updater.transports.reload import ReloadTransport

S = ReplicaState
G0 = Generation(number=0, label="g0")


class RecordingProvider(ReplicaProvider):
    """Restarts fail as a Ray cluster with no room would; every call is recorded."""

    name = "recording"
    launches = False

    def __init__(self, can_restart: bool) -> None:
        self.can_restart = can_restart  # type: ignore[misc]
        self.calls: list[str] = []

    @classmethod
    def from_settings(cls, settings: UpdaterSettings) -> Self:
        raise NotImplementedError

    def url(self, replica_id: str) -> str:
        return "http://vllm.test"

    async def start(self, replica_id: str) -> Location:
        raise NotImplementedError

    async def stop(self, replica_id: str) -> None:
        self.calls.append("stop")

    async def restart_fresh(self, replica_id: str) -> Location:
        self.calls.append("restart_fresh")
        raise PlacementError("no Ray node could host its actor within 5 s (it asks for {GPU=1})")

    async def locate(self, replica_id: str) -> Location:
        raise NotImplementedError

    async def incarnation(self, replica_id: str) -> str | None:
        return None

    async def alive(self, replica_id: str) -> bool | None:
        return None


async def tainted_replica(
    store: RedisStore, provider: ReplicaProvider
) -> tuple[Supervisor, ManagedReplica]:
    model = ensure_model("random", seed=1)
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.register_replica("r0", "http://vllm.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="i"
    )
    await store.taint("r0", "engine died", source="test")
    unreachable = httpx.MockTransport(lambda r: httpx.Response(503))
    engine = VllmEngine("http://vllm.test", timeout=1.0, transport=unreachable)
    handle = ReplicaHandle("r0", engine, read_manifest(model), Lifecycle(S.TAINTED, G0, "i"))
    cfg = ReplicaConfig(id="r0", url="http://vllm.test", model=model)
    settings = UpdaterSettings(replicas=[cfg])
    runner = CycleRunner(store, lease, ReloadTransport())
    m = ManagedReplica(cfg, handle)
    return Supervisor(settings, store, runner, {"r0": m}, provider), m


async def test_a_failed_restart_leaves_it_tainted_saying_why(store: RedisStore) -> None:
    """Before, a restart that failed left the replica RECOVERING until the next round called it
    'orphaned', which hid the cause. Now it is TAINTED, with the cause and what failed."""
    provider = RecordingProvider(can_restart=True)
    sup, m = await tainted_replica(store, provider)
    await sup.check(m, await store.replica("r0"))
    assert m.recovering is not None
    await m.recovering
    rec = await store.replica("r0")
    assert provider.calls == ["restart_fresh"]
    assert rec.state is S.TAINTED and m.handle.lc.state is S.TAINTED
    assert rec.reason == (
        "engine died; recovery failed: no Ray node could host its actor within 5 s "
        "(it asks for {GPU=1})"
    )
    # the next round tries again, and the reason does not grow
    await sup.check(m, rec)
    assert m.recovering is not None
    await m.recovering
    assert provider.calls == ["restart_fresh"] * 2
    assert (await store.replica("r0")).reason == rec.reason


async def test_a_provider_that_cannot_restart_is_never_asked_to(store: RedisStore) -> None:
    provider = RecordingProvider(can_restart=False)
    sup, m = await tainted_replica(store, provider)
    for _ in range(3):
        await sup.check(m, await store.replica("r0"))
    rec = await store.replica("r0")
    assert provider.calls == [] and m.recovering is None
    assert rec.state is S.TAINTED and WAITING_FOR_RESTART in rec.reason


async def test_an_unhealthy_replica_nobody_here_can_restart_says_who_must(
    store: RedisStore,
) -> None:
    """Found by the fault matrix: an external replica that died while READY was quarantined as
    "/health failed 3 times" only, so neither an operator nor an orchestrator was told that the
    updater waits for them to restart it."""
    provider = RecordingProvider(can_restart=False)
    sup, m = await tainted_replica(store, provider)
    token = sup.runner.lease.require()
    await store.transition("r0", token, S.TAINTED, S.RECOVERING)
    await store.transition("r0", token, S.RECOVERING, S.READY, generation=G0, identity_digest="i")
    m.handle.lc = Lifecycle(S.READY, G0, "i")
    for _ in range(sup.settings.health_failures):
        await sup.check(m, await store.replica("r0"))
    rec = await store.replica("r0")
    assert rec.state is S.TAINTED and "/health failed" in rec.reason
    assert WAITING_FOR_RESTART in rec.reason


async def test_a_taint_the_store_refused_is_written_by_the_next_check(store: RedisStore) -> None:
    """Found by the fault matrix (replication stalled in UPDATING): the cycle's taint was
    refused by Redis (NOREPLICAS), leaving the controller TAINTED and the record INVALIDATING;
    every later check then failed ('r0 is INVALIDATING, expected TAINTED') and the replica
    never recovered. Now the check taints the record itself."""
    provider = RecordingProvider(can_restart=False)
    sup, m = await tainted_replica(store, provider)
    token = sup.runner.lease.require()
    await store.transition("r0", token, S.TAINTED, S.RECOVERING)
    await store.transition("r0", token, S.RECOVERING, S.READY, generation=G0, identity_digest="i")
    for a, b in [(S.READY, S.DRAINING), (S.DRAINING, S.QUIESCED), (S.QUIESCED, S.UPDATING)]:
        await store.transition("r0", token, a, b)
    await store.transition("r0", token, S.UPDATING, S.INVALIDATING)
    m.handle.lc = Lifecycle(S.TAINTED, G0, "i", reason="invalidate: the store refused")
    await sup.check(m, await store.replica("r0"))
    rec = await store.replica("r0")
    assert rec.state is S.TAINTED and WAITING_FOR_RESTART in rec.reason


async def test_a_ready_replica_whose_process_was_replaced_is_tainted(store: RedisStore) -> None:
    """Found by the fault matrix: a stand-in restarted by its orchestrator while READY (faster
    than the health checks could see it down) kept its READY record, and routers sent
    rollouts of the published generation to a process serving what it was started with
    (17 of 30 answers cross-generation). The supervisor now checks that a READY replica is
    still the process that was validated. The stand-in is conformance-tested against vLLM on
    the /metrics identity it reports (tests/integration/test_standin_conformance.py)."""
    model = ensure_model("random", seed=1)
    async with StandinFleet(admin_port=0) as fleet:
        rep = await fleet.add(StandinConfig(model=model))
        engine = VllmEngine(rep.url, timeout=5.0)
        process = ProcessIdentity(str(await engine.process_identity()))
        lease = store.updater_lease("test")
        token = await lease.acquire()
        await store.register_replica("r0", rep.url, token)
        await store.transition(
            "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="i"
        )
        handle = ReplicaHandle("r0", engine, read_manifest(model), Lifecycle(S.READY, G0, "i"))
        handle.lc = Lifecycle(S.READY, G0, "i", process=process)
        cfg = ReplicaConfig(id="r0", url=rep.url, model=model)
        m = ManagedReplica(cfg, handle)
        provider = RecordingProvider(can_restart=False)
        settings = UpdaterSettings(replicas=[cfg])
        sup = Supervisor(
            settings, store, CycleRunner(store, lease, ReloadTransport()), {"r0": m}, provider
        )
        await sup.check(m, await store.replica("r0"))
        assert (await store.replica("r0")).state is S.READY  # the validated process: kept
        await rep.restart()
        await sup.check(m, await store.replica("r0"))
        rec = await store.replica("r0")
        assert rec.state is S.TAINTED and "server process was replaced" in rec.reason
        await engine.aclose()


async def test_stop_ends_the_supervisor_when_a_cancelled_read_says_unreachable(
    store: RedisStore,
) -> None:
    """redis-py can report a command cut by its task's cancellation as a lost connection, which
    the store reports as StoreUnavailable. The supervisor waits out outages, so it swallowed
    the cancellation and ran on, and Updater.stop() waited on it forever (a clean-clone run hung
    30 min in test_supervisor). Here the read is made to do exactly that on cancellation."""
    sup, _ = await tainted_replica(store, RecordingProvider(can_restart=False))
    started = asyncio.Event()

    async def read_that_hides_cancellation() -> object:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise StoreUnavailable("Redis at redis://x is unreachable (ConnectionError)") from None
        return {}

    sup.watch.versioned = read_that_hides_cancellation  # type: ignore[method-assign]
    task = asyncio.create_task(sup.run())
    await started.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=10)
    if not task.done():  # the bug: leave nothing running behind the test
        sup.watch.versioned = lambda: asyncio.sleep(3600)  # type: ignore[method-assign, assignment, return-value]
    assert task.cancelled(), "the supervisor swallowed its cancellation"


async def test_stop_ends_the_supervisor_wherever_in_its_round_the_cancellation_lands(
    store: RedisStore,
) -> None:
    """The other face of the same hang: on Python 3.11 a Redis read cancelled as redis-py's
    write completed returned normally (``asyncio.wait_for``), the supervisor's loop ran on, and
    Updater.stop() waited on it forever. Against real Redis, its rounds back to back, cancelled
    200 times at varying points: it ends every time."""
    sup, _ = await tainted_replica(store, RecordingProvider(can_restart=False))
    sup.settings = sup.settings.model_copy(update={"health_interval_s": 0.0001})
    ran_on = []
    for attempt in range(200):
        task = asyncio.create_task(sup.run())
        for _ in range(attempt % 50):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        if not task.cancelled():
            ran_on.append(attempt)
            sup.watch.versioned = lambda: asyncio.sleep(3600)  # type: ignore[method-assign, assignment, return-value]
            task.cancel()  # the bug: leave nothing running behind the test
    assert ran_on == [], f"the supervisor ran on after cancellations {ran_on}"
