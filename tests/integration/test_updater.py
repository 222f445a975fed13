"""The updater service on 2 real vLLM CPU replicas + real Redis: push API, rolling order,
one-updater lease, crash detection and recovery. Replicas serve marker checkpoints, so a
replica's output names the generation it is on."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from pool.errors import StoreConflict
from pool.launcher import ReplicaSpec, free_port
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.harness import local_launcher
from testkit.scenarios.reliability import watch_recovery
from updater.app import create_api
from updater.client import UpdateFailed, UpdaterClient
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

pytestmark = pytest.mark.integration
S = ReplicaState
TOKEN = "admin-secret"
PROMPT = list(range(10, 30))


def marker(g: int) -> str:
    return str(ensure_model("marker", token_id=marker_token(g)))


@dataclass
class Env:
    updater: Updater
    store: RedisStore
    url: str
    settings: UpdaterSettings
    store_settings: StoreSettings


@pytest_asyncio.fixture(scope="module")
async def env(redis_server, tmp_path_factory) -> AsyncIterator[Env]:  # type: ignore[no-untyped-def]
    base = ensure_model("marker", token_id=marker_token(0))
    replicas = [
        ReplicaConfig(
            id=f"r{i}",
            model=base,
            launch=ReplicaSpec(
                model=base,
                name=f"up-r{i}",
                cpu_bind=str(i),
                work_dir=tmp_path_factory.mktemp(f"up-r{i}"),
            ),
        )
        for i in range(2)
    ]
    settings = UpdaterSettings(
        admin_token=TOKEN,
        replicas=replicas,
        health_interval_s=0.5,
        health_failures=2,
        health_timeout_s=1.0,
    )
    store_settings = StoreSettings(url=redis_server.url, namespace="updater-it")
    store = RedisStore.connect(store_settings)
    updater = Updater(settings, store)
    await updater.start()
    app = create_api(updater, settings)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Env(updater, store, f"http://127.0.0.1:{port}", settings, store_settings)
    finally:
        await runner.cleanup()
        await updater.stop()
        await store.close()


async def output(env: Env, rid: str) -> tuple[int, ...]:
    return await env.updater.replicas[rid].handle.engine.complete(PROMPT, max_tokens=3)


def push(env: Env, g: int, *, expected: int | None = None) -> dict:  # type: ignore[type-arg]
    tok = marker_token(g if expected is None else expected)
    with UpdaterClient(env.url, TOKEN) as c:
        rec = c.push(marker(g), step=g, probe=(PROMPT, [tok] * 3))
        return c.wait(rec["id"], timeout_s=120)


async def test_bootstrap_publishes_g0_on_both(env: Env) -> None:
    recs = await env.store.replicas()
    assert [(r.state, r.generation) for r in recs] == [(S.READY, 0), (S.READY, 0)]
    for rid in ("r0", "r1"):
        assert await output(env, rid) == (marker_token(0),) * 3


async def test_rolling_update_keeps_one_replica_admitting(env: Env) -> None:
    start = len(await env.store.journal())
    rec = await asyncio.to_thread(push, env, 1)
    assert rec["state"] == "succeeded" and rec["generation"] == 1
    assert set(rec["replicas"]) == {"r0", "r1"}
    for rep in rec["replicas"].values():
        assert rep["outcome"] == "ready" and rep["window_s"] < 5
    # the staleness window: push -> published (first replica) -> rolled (every replica)
    assert rec["created_ms"] <= rec["published_ms"] <= rec["rolled_ms"] <= rec["finished_ms"]
    assert rec["staleness_window_s"] == (rec["rolled_ms"] - rec["created_ms"]) / 1000
    for rid in ("r0", "r1"):
        assert await output(env, rid) == (marker_token(1),) * 3

    # replay the journal: never both replicas out of READY, and always >= 1 admitting replica
    state = {"r0": ("READY", 0), "r1": ("READY", 0)}
    latest = 0
    for e in (await env.store.journal())[start:]:
        f = e.fields
        if e.type == "transition":
            gen = int(f["generation"]) if f.get("generation") else state[f["replica"]][1]
            state[f["replica"]] = (f["to"], gen)
        elif e.type == "publish":
            latest = int(f["generation"])
        else:
            continue
        out = [r for r, (s, _) in state.items() if s != "READY"]
        assert len(out) <= 1, f"max_unavailable violated at {e}"
        admitting = [r for r, (s, g) in state.items() if s == "READY" and g == latest]
        assert admitting, f"no admitting replica after {e}"


async def test_push_is_checked_before_queueing(env: Env) -> None:
    wide = str(ensure_model("random", seed=1, intermediate_size=512))
    async with httpx.AsyncClient(base_url=env.url) as http:
        body = {
            "checkpoint": marker(2),
            "probe": {"prompt_token_ids": [1], "expected_token_ids": [2]},
        }
        assert (await http.post("/v1/updates", json=body)).status_code == 401
        r = await http.post("/v1/updates", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for bad, code in [
            ({**body, "checkpoint": "/nonexistent/ckpt"}, "preflight_failed"),
            ({**body, "checkpoint": wide}, "preflight_failed"),
            ({**body, "checkpoint": "relative/path"}, "invalid_body"),
            ({"checkpoint": marker(2)}, "invalid_body"),
        ]:
            r = await http.post("/v1/updates", json=bad, headers=auth)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == code
        r = await http.post("/v1/updates", content=b"{nope", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON")
        r = await http.get("/v1/updates/up-missing", headers=auth)
        assert r.status_code == 404
        assert (await http.get("/healthz")).json()["status"] == "ok"
        assert "rolloutpool_replica_generation" in (await http.get("/metrics")).text
    assert (await env.store.latest())[0].number == 1  # type: ignore[index]  # nothing queued ran


async def test_failed_validation_stops_the_update_before_publishing(env: Env) -> None:
    with pytest.raises(UpdateFailed) as e:
        await asyncio.to_thread(push, env, 2, expected=9)
    rec = e.value.record
    assert rec["state"] == "failed" and len(rec["replicas"]) == 1
    assert (await env.store.latest())[0].number == 1  # type: ignore[index]
    # the tainted replica is recovered on the latest published generation (g1)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        recs = await env.store.replicas()
        if all(r.state is S.READY and r.generation == 1 for r in recs):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"not recovered: {await env.store.replicas()}")


async def test_second_updater_waits_on_the_lease(env: Env) -> None:
    other = Updater(env.settings, RedisStore.connect(env.store_settings))
    with pytest.raises(StoreConflict):
        await other.start(lease_timeout_s=1.0)
    await other.store.close()


async def test_killed_replica_is_detected_and_recovered_at_latest(env: Env) -> None:
    launcher = local_launcher(env.updater, "r1")
    await env.store.admit("inflight", "r1")
    t0 = time.monotonic()
    launcher.kill(signal.SIGKILL)
    detected, recovered = await watch_recovery(env.store, "r1", t0, timeout_s=240, poll_s=0.1)
    assert detected is not None and detected < 5, detected
    assert recovered is not None
    rec = await env.store.replica("r1")
    b = await env.store.binding("inflight")
    assert b.state.value == "aborted" and "tainted" in b.reason
    assert (rec.generation, rec.label) == (1, "g1")
    assert await output(env, "r1") == (marker_token(1),) * 3
    print(f"crash detected after {detected:.2f}s, recovered after {recovered:.1f}s")
