"""The supervisor routes recovery through the replica provider (issue 17), with a real Redis store
and a provider that records its calls (the adapters run for real in tests/integration and in
tests/unit/test_providers_kubernetes.py). The engine is never reached in these paths."""

from __future__ import annotations

from typing import Self

import httpx

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.lifecycle import Lifecycle
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from testkit.models import ensure_model
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
