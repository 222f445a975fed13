"""The contract when the control plane itself fails, on real redis-server processes: a
restarting updater, a fenced-out updater, a write that is not replicated, Redis restarting
before a transfer. Each test fails on the code before its fix. Real updater processes killed
and stopped by pid, with real vLLM replicas, are in tests/integration/test_updater_faults.py."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar, Self

import pytest
from prometheus_client import CollectorRegistry

from pool.checkpoint import read_manifest
from pool.errors import AdmissionRefused, NotReplicated, StaleFencingToken, StoreUnavailable
from pool.evidence import DrainRequested
from pool.launcher import ReplicaSpec
from pool.lifecycle import Lifecycle
from pool.metrics import RouterMetrics
from pool.records import UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore, UpdaterLease
from pool.types import Generation, ReplicaState
from rolloutpool.local.models import ensure_model
from router.bindings import Bindings
from router.failover import FailoverGuard
from testkit.redis_server import RedisServer
from tests.unit.test_updater_cycle import IDENT, MODEL, recording_engine, replica_r0
from updater.cycle import CycleRunner, Probe, ReplicaHandle, UpdateTarget
from updater.failover import EpochGate
from updater.providers.base import Location, ReplicaProvider
from updater.providers.leash import start_ticks
from updater.providers.local import LocalProvider
from updater.records import Records
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings
from updater.transports.reload import ReloadTransport

S = ReplicaState
G0, G1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")


async def ready_r0(store: RedisStore, url: str = "http://a.test") -> tuple[UpdaterLease, int]:
    lease = store.updater_lease("first")
    token = await lease.acquire()
    await store.register_replica("r0", url, token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    return lease, token


async def take_over(store: RedisStore) -> tuple[UpdaterLease, int]:
    """Another updater takes the lease, as after the first one's lease expired."""
    await store.r.delete(store.k.lease)
    lease = store.updater_lease("second")
    return lease, await lease.acquire()


async def test_a_known_replica_registered_at_a_new_url_is_tainted_at_once(
    store: RedisStore,
) -> None:
    """Before: REGISTER overwrote the URL and left the replica READY, so routers admitted to a
    server nobody validated (an updater restart: 29 rollouts answered as g1 from g0 weights)."""
    _, token = await ready_r0(store)
    assert await store.register_replica("r0", "http://a.test", token) is S.READY  # same server
    assert await store.register_replica("r0", "http://b.test", token) is S.TAINTED
    rec = await store.replica("r0")
    assert rec.state is S.TAINTED and rec.url == "http://b.test"
    assert "new address" in rec.reason
    with pytest.raises(AdmissionRefused, match="not_ready"):
        await store.admit("ro-1", "r0")


async def test_a_fenced_out_updater_writes_no_taint(store: RedisStore) -> None:
    """Before: ``_taint`` caught StaleFencingToken (a StoreConflict) and fell back to the
    unfenced taint, so an updater resumed after SIGSTOP tainted the new holder's replica."""
    calls: list[str] = []
    handle, runner = await replica_r0(store, recording_engine(calls))
    old_token = runner.lease.require()
    _, new_token = await take_over(store)
    written = len(await store.journal())
    with pytest.raises(StaleFencingToken):
        await store.taint("r0", "stale", source="updater", token=old_token)
    await runner._taint(handle, "transfer", RuntimeError("cut"))
    rec = await store.replica("r0")
    assert rec.state is S.READY, rec.reason
    assert handle.lc.state is S.TAINTED  # the stale updater's own view only
    assert len(await store.journal()) == written  # not one write with the stale token
    await store.taint("r0", "by the holder", source="updater", token=new_token)
    assert (await store.replica("r0")).state is S.TAINTED
    await handle.engine.aclose()


class RecordingProvider(ReplicaProvider):
    """Launches nothing; records which replicas the updater stopped."""

    name = "recording"
    launches = True
    can_restart = True
    adopts: ClassVar[bool] = False

    def __init__(self) -> None:
        self.stopped: list[str] = []

    @classmethod
    def from_settings(cls, settings: UpdaterSettings) -> Self:
        return cls()

    def url(self, replica_id: str) -> str:
        return "http://a.test"

    async def start(self, replica_id: str) -> Location:
        return Location("http://a.test", "127.0.0.1")

    async def stop(self, replica_id: str) -> None:
        self.stopped.append(replica_id)

    async def restart_fresh(self, replica_id: str) -> Location:
        return Location("http://a.test", "127.0.0.1")

    async def locate(self, replica_id: str) -> Location:
        return Location("http://a.test", "127.0.0.1")

    async def incarnation(self, replica_id: str) -> str | None:
        return None

    async def alive(self, replica_id: str) -> bool | None:
        return None


class AdoptingProvider(RecordingProvider):
    adopts: ClassVar[bool] = True


def updater_with(store: RedisStore, provider: ReplicaProvider) -> Updater:
    model = ensure_model("random", seed=1)
    settings = UpdaterSettings(replicas=[ReplicaConfig(id="r0", url="http://a.test", model=model)])
    return Updater(settings, store, provider=provider, transport=ReloadTransport())


@pytest.mark.parametrize("provider_cls", [RecordingProvider, AdoptingProvider])
async def test_an_updater_that_lost_the_lease_stops_without_writing(
    store: RedisStore, provider_cls: type[RecordingProvider]
) -> None:
    """Before: the SIGTERM shutdown of a fenced-out updater tainted both of the new holder's
    replicas ("stopped with its updater", no lease check). Now it writes nothing; it still ends
    processes only it can own (a provider whose processes another updater adopts: left)."""
    provider = provider_cls()
    up = updater_with(store, provider)
    await up.lease.acquire()
    lease, token = await take_over(store)
    await store.register_replica("r0", "http://a.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    await up.stop()
    assert (await store.replica("r0")).state is S.READY
    assert provider.stopped == ([] if provider.adopts else ["r0"])
    assert await store.r.get(store.k.lease) == str(token)  # its release did not touch it
    await lease.release()


async def test_an_updater_with_the_lease_taints_what_it_stops(store: RedisStore) -> None:
    provider = RecordingProvider()
    up = updater_with(store, provider)
    token = await up.lease.acquire()
    await store.register_replica("r0", "http://a.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    await up.stop()
    rec = await store.replica("r0")
    assert rec.state is S.TAINTED and rec.reason == "stopped with its updater"
    assert rec.fence == token and provider.stopped == ["r0"]


def running_record(update_id: str) -> UpdateRecord:
    return UpdateRecord(
        id=update_id,
        state=UpdateState.RUNNING,
        generation=1,
        label="g1",
        checkpoint="/x",
        identity_digest="d",
        created_ms=1,
    )


async def test_updates_an_earlier_updater_left_running_end_failed(store: RedisStore) -> None:
    """Before: an update interrupted by its updater's crash stayed ``running`` for ever."""
    rec = running_record("up-left")
    await store.save_update(rec)
    up = updater_with(store, RecordingProvider())
    await up.lease.acquire()
    await up.records.finish_interrupted()
    left = await store.update("up-left")
    assert left.state is UpdateState.FAILED and "interrupted" in (left.error or "")
    await up.lease.release()


@pytest.fixture
def replicated(tmp_path: Path) -> Any:
    """A real primary with one real replica (``replicaof``), in sync."""
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(
        tmp_path / "replica", extra=["--replicaof", "127.0.0.1", str(primary.port)]
    ).start()
    yield primary, replica
    replica.signal(signal.SIGCONT)
    replica.stop()
    primary.stop()


async def test_a_transition_not_replicated_is_not_acted_on_until_it_is(replicated: Any) -> None:
    """Before: NotReplicated (a StoreUnavailable) was caught by the commit, which read its own
    write back from the primary and went on: the updater drained and transferred on a
    transition a promotion could erase. Now the controller moves only once the replica holds
    it: with the replica stopped (SIGSTOP) the commit waits; resumed, it completes. The set-up
    is written without waiting for the replica, then waited for until the replica holds it (a
    loaded host may take longer than one 0.2 s WAIT to acknowledge a write)."""
    primary, replica = replicated
    plain = StoreSettings(url=primary.url, namespace="repl")
    setup = RedisStore.connect(plain)
    store = RedisStore.connect(plain.model_copy(update={"wait_replicas": 1, "wait_timeout_s": 0.2}))
    try:
        lease = setup.updater_lease("u")
        token = await lease.acquire()
        await setup.register_replica("r0", "http://a.test", token)
        await setup.transition(
            "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="i", publish=True
        )
        deadline = time.monotonic() + 30
        while True:  # until the replica has synced the set-up and acknowledges writes
            try:
                await store.confirm_replicated()
                break
            except NotReplicated:
                assert time.monotonic() < deadline, "the replica never caught up"
        handle = ReplicaHandle(
            "r0", recording_engine([]), read_manifest(MODEL), Lifecycle(S.READY, G0, "i")
        )
        runner = CycleRunner(store, lease, ReloadTransport(), store_retry_s=0.6)
        replica.signal(signal.SIGSTOP)
        with pytest.raises(NotReplicated):
            await runner.commit(handle, DrainRequested(G1, "id1"))
        assert handle.lc.state is S.READY  # nothing acted on it
        assert (await setup.replica("r0")).state is S.DRAINING  # on the primary only

        runner.store_retry_s = 60.0
        handle.lc = Lifecycle(S.READY, G0, "i")
        await setup.transition("r0", token, S.DRAINING, S.READY, generation=G0, identity_digest="i")
        commit = asyncio.create_task(runner.commit(handle, DrainRequested(G1, "id1")))
        while (await setup.replica("r0")).state is not S.DRAINING:
            await asyncio.sleep(0.02)
        assert not commit.done() and handle.lc.state is S.READY
        replica.signal(signal.SIGCONT)
        await asyncio.wait_for(commit, 30)
        assert handle.lc.state is S.DRAINING
        await handle.engine.aclose()
    finally:
        await setup.close()
        await store.close()


async def test_a_redis_restart_before_the_transfer_is_waited_out(tmp_path: Path) -> None:
    """Before: the epoch check after QUIESCED -> UPDATING had no retry, so a Redis restart in
    that gap (no weight moved yet) tainted the replica and cost a process restart. Now the new
    epoch is settled, the record read again in it, and the update goes on to READY."""
    server = RedisServer(tmp_path / "redis").start()
    store = RedisStore.connect(StoreSettings(url=server.url, namespace="gap"))
    try:
        calls: list[str] = []
        handle, runner = await replica_r0(store, recording_engine(calls, [3, 4]))
        gate = EpochGate(store, poll_s=0.05, timeout_s=60)
        runner.gate = gate
        real = gate.unchanged
        restarted: list[bool] = []

        async def restart_first(epoch: Any) -> None:
            if not restarted:
                restarted.append(True)
                await asyncio.to_thread(server.stop)
                await asyncio.to_thread(server.start)  # same data (AOF), a new primary identity
            await real(epoch)

        gate.unchanged = restart_first  # type: ignore[method-assign]
        report = await runner.run(handle, UpdateTarget(G1, IDENT, MODEL, Probe((1, 2), (3, 4))))
        assert restarted and report.outcome == "ready", report.reason
        rec = await store.replica("r0")
        assert rec.state is S.READY and rec.generation == 1
        assert sum(1 for c in calls if c == "POST /collective_rpc") == 1
        await handle.engine.aclose()
    finally:
        await store.close()
        server.stop()


async def test_a_left_over_local_replica_is_found_by_its_identity_and_ended(
    tmp_path: Path,
) -> None:
    """Before: after an updater crash its local replicas lived on as orphans, serving and
    holding the cores the new updater's fresh starts needed. The local provider now tells a
    group an earlier updater left on this host by its recorded incarnation and ends it; a pid
    recorded on another host, or with another start time, is never touched."""
    left = subprocess.Popen(["sleep", "600"], start_new_session=True)  # noqa: ASYNC220
    try:
        started = start_ticks(left.pid)
        assert started is not None
        model = ensure_model("random", seed=1)
        spec = ReplicaSpec(model=model, work_dir=tmp_path / "r0")
        provider = LocalProvider([ReplicaConfig(id="r0", model=model, launch=spec)])
        here = socket.gethostname()
        assert not await provider.reclaimable("r0", f"pid:{left.pid}@{started}@other-host")
        assert not await provider.reclaimable("r0", f"pid:{left.pid}@{started + 1}@{here}")
        mine = f"pid:{left.pid}@{started}@{here}"
        assert await provider.reclaimable("r0", mine)
        await provider.reclaim("r0", mine)
        assert left.wait(10) == -signal.SIGKILL
        assert not await provider.reclaimable("r0", mine)
    finally:
        left.kill()
        left.wait()


async def test_a_session_admission_not_replicated_leaves_no_slot_taken(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before: a session admission answered NotReplicated (503) kept its binding active on the
    primary for the whole session lease (300 s), so retries during a replication stall filled
    the pool. Now the binding is released at once."""
    await ready_r0(store)
    waiting = RedisStore.connect(
        store_settings.model_copy(update={"wait_replicas": 1, "wait_timeout_s": 0.05})
    )
    try:
        for i in range(3):
            with pytest.raises(NotReplicated):
                await waiting.admit(f"s-{i}", "r0", session=True)
        assert (await store.replica("r0")).active == 0
        binding = await store.binding("s-0")
        assert binding.state == "aborted" and binding.reason == "admission not replicated"
    finally:
        await waiting.close()


async def test_a_fenced_out_updater_does_not_overwrite_update_records(store: RedisStore) -> None:
    """Found by the fault matrix (updater SIGSTOPped in UPDATING): resumed, the old updater
    saved its record as ``running`` again over the FAILED its successor wrote."""
    up = updater_with(store, RecordingProvider())
    await up.lease.acquire()
    rec = running_record("up-stale")
    await up.records.save(rec)
    up.lease.valid_until = 0.0  # stopped past its lease
    up.lost.set()  # and, resumed, found it taken
    successor = updater_with(store, RecordingProvider())
    await store.r.delete(store.k.lease)
    await successor.lease.acquire()
    await successor.records.finish_interrupted()
    await up.records.save(rec)  # the stale updater's view, after it resumed
    assert (await store.update("up-stale")).state is UpdateState.FAILED
    await successor.lease.release()


async def test_a_router_round_against_a_frozen_redis_is_bounded(tmp_path: Path) -> None:
    """Audit finding: a failover round blocked on a frozen primary (SIGSTOP: its sockets stay
    open) could outlive the router's registration before the router fenced itself. Each round
    now ends within a quarter of ``failover_grace_s``."""
    server = RedisServer(tmp_path / "redis").start()
    # a socket timeout far beyond the grace: without the bound a round waits it out
    settings = StoreSettings(
        url=server.url, namespace="guard", failover_grace_s=2.0, socket_timeout_s=60.0
    )
    store = RedisStore.connect(settings)
    try:
        guard = FailoverGuard(store, Bindings(store, RouterMetrics.create(CollectorRegistry())))
        await guard.tick()
        assert guard.bindings.epoch is not None
        server.signal(signal.SIGSTOP)
        for _ in range(3):
            t0 = time.monotonic()
            await guard.tick()
            assert time.monotonic() - t0 < 20  # bounded by grace/4, not by the 60 s socket
    finally:
        server.signal(signal.SIGCONT)
        await store.close()
        server.stop()


async def test_a_record_saved_while_the_lease_is_renewed_after_an_outage_is_kept(
    store: RedisStore,
) -> None:
    """Found by the fault matrix (Redis SIGSTOPped past the lease): the updater's lease lapsed
    locally and its keeper re-acquired it a moment later; an update pushed in that moment
    failed and its FAILED record was dropped, so it stayed ``queued``. The worker and the
    record saves now wait (up to one TTL) for the keeper to re-acquire the lease."""
    up = updater_with(store, RecordingProvider())
    await up.lease.acquire()
    up.lease.valid_until = 0.0  # lapsed while Redis was away

    async def keeper() -> None:
        await asyncio.sleep(0.2)
        await store.r.delete(store.k.lease)  # its key expired meanwhile
        await up.lease.acquire(blocking_timeout_s=5)  # nobody else took it: re-acquired

    renew = asyncio.create_task(keeper())
    await up.records.save(running_record("up-after-outage"))
    await renew
    assert (await store.update("up-after-outage")).state is UpdateState.RUNNING
    await up.lease.release()


async def test_a_primary_refusing_writes_in_a_pipeline_is_unavailable_not_an_error(
    tmp_path: Path,
) -> None:
    """Found by the fault matrix (replication stalled): a primary with no replica in sync
    (``min-replicas-to-write``) answers NOREPLICAS, which a pipeline wraps as "Command # 1
    (...) of pipeline caused error: ('NOREPLICAS ...',)". That was taken for a plain
    StoreError, so the cycle gave up at once instead of waiting it out like an outage."""
    server = RedisServer(tmp_path / "lonely", extra=["--min-replicas-to-write", "1"]).start()
    store = RedisStore.connect(
        StoreSettings(url=server.url, namespace="lonely", wait_replicas=1, wait_timeout_s=0.2)
    )
    try:
        with pytest.raises(StoreUnavailable, match="refuses writes for now \\(NOREPLICAS\\)"):
            await store.save_update(running_record("up-1"))  # a MULTI/EXEC pipeline
    finally:
        await store.close()
        server.stop()


async def test_an_ended_update_whose_last_save_was_lost_is_saved_again(tmp_path: Path) -> None:
    """Found by the fault matrix (the Sentinel rig, the primary stopped while r0 was
    INVALIDATING): an update's last save failed (Redis away in the failover) or landed on a
    primary the failover then lost, and nothing saved it again: the store showed the update
    running for good. The updater now reads every ended record back and saves it again until
    the store has held its end for a while."""
    server = RedisServer(tmp_path / "redis").start()
    store = RedisStore.connect(
        StoreSettings(url=server.url, namespace="rec", socket_timeout_s=0.5, pool_timeout_s=0.5)
    )
    lease = store.updater_lease("u")
    await lease.acquire()
    records = Records(store, lease, asyncio.Event(), watch_interval_s=0.05, settle_s=0.2)
    watch = asyncio.create_task(records.watch())
    try:
        running = running_record("up-lost")
        await records.save(running)
        ended = running.model_copy(update={"state": UpdateState.SUCCEEDED})
        server.signal(signal.SIGSTOP)  # the last save fails: Redis away
        await records.save(ended)
        server.signal(signal.SIGCONT)
        while (await store.update("up-lost")).state is not UpdateState.SUCCEEDED:
            await asyncio.sleep(0.02)
        await store.save_update(running)  # a failover lost it: the store is back to running
        while (await store.update("up-lost")).state is not UpdateState.SUCCEEDED:
            await asyncio.sleep(0.02)
        while records.unsettled:  # held long enough: forgotten
            await asyncio.sleep(0.02)
    finally:
        server.signal(signal.SIGCONT)
        watch.cancel()
        await store.close()
        server.stop()
