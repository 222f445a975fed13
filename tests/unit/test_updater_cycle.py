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
from pool.evidence import DrainRequested, ProcessIdentity
from pool.lifecycle import Lifecycle
from pool.records import ReplicaReport
from pool.store import RedisStore
from pool.types import Generation, ReplicaState, WeightIdentity
from rolloutpool.local.models import ensure_model
from updater.cycle import CycleRunner, Probe, ReplicaHandle, UpdateTarget
from updater.transports.reload import ReloadTransport

S = ReplicaState
G0, G1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")


def recording_engine(calls: list[str], probe_output: list[int] | None = None) -> VllmEngine:
    """A vLLM 0.32 control plane that answers every call of a successful cycle and records it."""
    state = {"paused": False, "label": "g0"}

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        answers: dict[str, object] = {
            "/version": {"version": "0.32.0"},
            "/v1/models": {"data": [{"id": "m"}]},
            "/is_paused": {"is_paused": state["paused"]},
            "/collective_rpc": {"results": [None]},
            "/reset_prefix_cache": {"success": True},
            "/weight_info": {"weight_version": state["label"]},
            "/v1/completions": {"choices": [{"token_ids": probe_output or []}]},
        }
        if path == "/pause":
            state["paused"] = True
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            state["paused"] = False
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/update_weight_version":
            state["label"] = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": state["label"]})
        if path in ("/reset_mm_cache", "/reset_encoder_cache"):
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 0\n")
        if path in answers:
            return httpx.Response(200, json=answers[path])
        return httpx.Response(404, text=json.dumps({"error": path}))

    return VllmEngine("http://vllm.test", timeout=2.0, transport=httpx.MockTransport(handle))


MODEL = ensure_model("random", seed=1)
IDENT = WeightIdentity(manifest_digest=read_manifest(MODEL).digest, checkpoint_uri=str(MODEL))


async def replica_r0(store: RedisStore, engine: VllmEngine) -> tuple[ReplicaHandle, CycleRunner]:
    """r0 READY on g0 in the store (this test holds the lease), its engine the given fake."""
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.register_replica("r0", "http://vllm.test", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G0, identity_digest="id0", publish=True
    )
    await engine.bootstrap()
    manifest = read_manifest(MODEL)
    handle = ReplicaHandle(
        "r0", engine, manifest, Lifecycle(S.READY, G0, "id0", process=ProcessIdentity("p"))
    )
    return handle, CycleRunner(store, lease, ReloadTransport(), drain_timeout_s=30)


async def test_progress_is_told_each_phase_as_it_begins(store: RedisStore) -> None:
    """A trainer follows an update live (the CLI's push): the runner tells each phase as it
    begins, in order, and the report ends with every phase timed and none running."""
    calls: list[str] = []
    handle, runner = await replica_r0(store, recording_engine(calls, [3, 4]))
    seen: list[tuple[str | None, tuple[str, ...]]] = []

    async def progress(report: ReplicaReport) -> None:
        seen.append((report.phase, tuple(report.phases)))

    report = await runner.run(
        handle, UpdateTarget(G1, IDENT, MODEL, Probe((1, 2), (3, 4))), progress
    )
    order = ["preflight", "drain", "pause", "transfer", "invalidate", "validate", "resume"]
    assert [phase for phase, _ in seen] == order
    assert [done for _, done in seen] == [tuple(order[:i]) for i in range(len(order))]
    assert report.outcome == "ready" and report.phase is None and list(report.phases) == order
    assert (await store.replica("r0")).generation == 1
    await handle.engine.aclose()


async def test_no_engine_call_once_the_lease_may_have_lapsed(store: RedisStore) -> None:
    """Fencing covered Redis writes but not engine calls. A lease that
    may have lapsed while the drain waited (renewals stopped) must stop the runner before it
    pauses the engine: nothing that changes the engine is sent."""
    calls: list[str] = []
    handle, runner = await replica_r0(store, recording_engine(calls))
    lease = runner.lease
    await store.admit("ro-held", "r0")

    async def lapse_then_release() -> None:
        while (await store.replica("r0")).state is not S.DRAINING:
            await asyncio.sleep(0.01)
        lease.valid_until = 0.0  # as if no renewal came back within the lease's TTL
        await store.release("ro-held", "r0")

    helper = asyncio.create_task(lapse_then_release())
    calls.clear()
    with pytest.raises(StaleFencingToken):
        await runner.run(handle, UpdateTarget(G1, IDENT, MODEL, Probe((1, 2), (3, 4))))
    await helper
    assert [c for c in calls if c.startswith("POST")] == [], calls
    # left DRAINING (weights untouched) for whoever holds the lease next to adopt or recover
    assert (await store.replica("r0")).state is S.DRAINING
    await handle.engine.aclose()


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
