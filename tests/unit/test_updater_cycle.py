"""The cycle runner's fencing of engine calls, with a real Redis store and an engine whose HTTP
layer is ``httpx.MockTransport`` (it records every call; a real server cannot tell us which calls
were *not* made). Cycles against real vLLM CPU servers are in tests/integration/test_cycle.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import StaleFencingToken, StoreUnavailable
from pool.evidence import DrainRequested
from pool.lifecycle import Lifecycle
from pool.store import RedisStore
from pool.types import Generation, ReplicaState, WeightIdentity
from testkit.models import ensure_model
from updater.cycle import CycleRunner, Probe, ReplicaHandle, UpdateTarget
from updater.transports.reload import ReloadTransport

S = ReplicaState
G0, G1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")


def recording_engine(calls: list[str]) -> VllmEngine:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        path = request.url.path
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/pause":
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": True})
        if path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 0\n")
        return httpx.Response(404, text=json.dumps({"error": path}))

    return VllmEngine("http://vllm.test", timeout=2.0, transport=httpx.MockTransport(handle))


async def test_no_engine_call_once_the_lease_may_have_lapsed(store: RedisStore) -> None:
    """Audit finding (issue 11): fencing covered Redis writes but not engine calls. A lease that
    may have lapsed while the drain waited (renewals stopped) must stop the runner before it
    pauses the engine: nothing that changes the engine is sent."""
    model = ensure_model("random", seed=1)
    manifest = read_manifest(model)
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.register_replica("r0", "http://vllm.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    calls: list[str] = []
    engine = recording_engine(calls)
    await engine.bootstrap()
    handle = ReplicaHandle("r0", engine, manifest, Lifecycle(S.READY, G0, "id0", process="p"))
    runner = CycleRunner(store, lease, ReloadTransport(), drain_timeout_s=30.0)
    ident = WeightIdentity(manifest_digest=manifest.digest, checkpoint_uri=str(model))
    await store.admit("ro-held", "r0")

    async def lapse_then_release() -> None:
        while (await store.replica("r0")).state is not S.DRAINING:
            await asyncio.sleep(0.01)
        lease.valid_until = 0.0  # as if no renewal came back within the lease's TTL
        await store.release("ro-held", "r0")

    helper = asyncio.create_task(lapse_then_release())
    calls.clear()
    with pytest.raises(StaleFencingToken):
        await runner.run(handle, UpdateTarget(G1, ident, model, Probe((1, 2), (3, 4))))
    await helper
    assert [c for c in calls if c.startswith("POST")] == [], calls
    # left DRAINING (weights untouched) for whoever holds the lease next to adopt or recover
    assert (await store.replica("r0")).state is S.DRAINING
    await engine.aclose()


@pytest.mark.parametrize("landed", [True, False])
async def test_a_commit_survives_a_lost_reply(store: RedisStore, landed: bool) -> None:
    """Redis fails over under a commit: the CAS landed but its reply was lost (``landed``), or
    it never ran. Before, the cycle failed and the replica was tainted and restarted; now the
    commit waits for Redis and reads the record back: done, or retried."""
    model = ensure_model("random", seed=1)
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.register_replica("r0", "http://vllm.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    handle = ReplicaHandle(
        "r0", recording_engine([]), read_manifest(model), Lifecycle(S.READY, G0, "id0")
    )
    runner = CycleRunner(store, lease, ReloadTransport(), store_retry_s=5.0)
    real = store.transition
    failed: list[bool] = []

    async def flaky(*args: Any, **kw: Any) -> int:
        if not failed:
            failed.append(True)
            if landed:
                await real(*args, **kw)
            raise StoreUnavailable("Redis at x is unreachable (ConnectionError)")
        return await real(*args, **kw)

    store.transition = flaky  # type: ignore[method-assign]
    await runner.commit(handle, DrainRequested(G1, "id1"))
    assert failed and handle.lc.state is S.DRAINING
    assert (await store.replica("r0")).state is S.DRAINING
