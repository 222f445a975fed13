"""I6 for replicas the pool does not launch (Kubernetes, compose): a tainted replica comes back
only as a new server process with the latest generation loaded from scratch.

One real vLLM CPU replica runs *outside* the updater (its config has only a ``url``), exactly as a
Kubernetes pod would. Both tests pin what a hardening audit found:

* an updater restarted while a replica sat in UPDATING re-published it READY on the same process
  with no reload: now it stays TAINTED, its reason saying that its orchestrator must restart it,
  until the process is replaced; then it recovers with the weights loaded from scratch;
* a replica tainted for a provenance violation was READY again 2.7 s after one slow ``/health``:
  a server that stalls and answers again is the same process, so it stays TAINTED.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from pool.launcher import LocalReplica, ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaRecord, ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.redis_server import RedisServer
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings
from updater.supervisor import WAITING_FOR_RESTART

pytestmark = pytest.mark.integration
S = ReplicaState
CHECKS = 6  # supervisor rounds a state must survive to count as "stays"


@dataclass
class Env:
    replica: LocalReplica
    store: RedisStore
    settings: UpdaterSettings


@pytest_asyncio.fixture(scope="module")
async def env(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Env]:
    model = ensure_model("marker", token_id=marker_token(0))
    replica = LocalReplica(
        ReplicaSpec(model=model, name="ext", cpu_bind="0", work_dir=tmp_path_factory.mktemp("ext"))
    )
    await replica.start()
    settings = UpdaterSettings(
        replicas=[ReplicaConfig(id="ext", url=replica.url, model=model)],
        health_interval_s=0.2,
        health_timeout_s=1.0,
        health_failures=2,
    )
    store = RedisStore.connect(StoreSettings(url=redis_server.url, namespace="supervisor-it"))
    try:
        yield Env(replica, store, settings)
    finally:
        await store.close()
        await replica.stop()


async def until(store: RedisStore, cond: str, ok: object, timeout_s: float) -> ReplicaRecord:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await store.replica("ext")
        if ok(rec):  # type: ignore[operator]
            return rec
        assert time.monotonic() < deadline, f"not {cond} after {timeout_s}s: {rec}"
        await asyncio.sleep(0.1)


async def stays_tainted(env: Env, process: str | None, since: int) -> ReplicaRecord:
    """Several supervisor rounds pass and the replica is still TAINTED on the same process, and
    the journal shows no move out of TAINTED since entry ``since``."""
    await asyncio.sleep(CHECKS * env.settings.health_interval_s)
    rec = await env.store.replica("ext")
    assert rec.state is S.TAINTED, rec
    assert WAITING_FOR_RESTART in rec.reason, rec.reason
    assert rec.process == process
    moves = [
        (e.fields["from"], e.fields["to"])
        for e in (await env.store.journal())[since:]
        if e.type == "transition" and e.fields["to"] != "TAINTED"
    ]
    assert moves == [], moves
    return rec


async def test_updater_restart_mid_transfer_waits_for_a_new_process(env: Env) -> None:
    first = Updater(env.settings, env.store)
    await first.start()
    rec = await env.store.replica("ext")
    assert rec.state is S.READY and rec.process is not None
    p1 = rec.process
    # the first updater is mid-transfer when it dies: UPDATING, engine paused
    token = first.lease.require()
    for a, b in [(S.READY, S.DRAINING), (S.DRAINING, S.QUIESCED), (S.QUIESCED, S.UPDATING)]:
        await env.store.transition("ext", token, a, b)
    await first.replicas["ext"].handle.engine.pause("wait", clear_cache=False)
    await first.stop(stop_replicas=False)

    since = len(await env.store.journal())
    second = Updater(env.settings, env.store)
    await second.start(lease_timeout_s=30)
    try:
        await stays_tainted(env, p1, since)
        # the orchestrator replaces the process: now it recovers, weights loaded from scratch
        await env.replica.restart()
        rec = await until(env.store, "READY", lambda r: r.state is S.READY, 180)
        assert rec.process is not None and rec.process != p1
        assert rec.generation == 0
        assert (
            await second.replicas["ext"].handle.engine.complete([5, 6, 7], 2)
            == (marker_token(0),) * 2
        )
    finally:
        await second.stop(stop_replicas=False)


async def test_violation_taint_survives_a_stalled_health_check(env: Env) -> None:
    up = Updater(env.settings, env.store)
    await up.start(lease_timeout_s=30)
    try:
        rec = await until(env.store, "READY", lambda r: r.state is S.READY, 60)
        process = rec.process
        since = len(await env.store.journal())
        await env.store.taint("ext", "provenance violation: two spans", source="router")
        await until(env.store, "quarantined", lambda r: WAITING_FOR_RESTART in r.reason, 10)
        env.replica.kill(signal.SIGSTOP)  # a slow /health, then the same process answers again
        try:
            await asyncio.sleep(3 * env.settings.health_timeout_s)
        finally:
            env.replica.kill(signal.SIGCONT)
        rec = await stays_tainted(env, process, since)
        assert rec.reason.startswith("provenance violation"), rec.reason
    finally:
        await up.stop(stop_replicas=False)
