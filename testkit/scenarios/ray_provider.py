"""The Ray provider on a real 2-node Ray cluster of this machine, with real vLLM CPU replicas.

    python -m bench.ray_provider            # the full run -> bench/results/ray_provider.json
    tests/integration/test_ray_provider.py  # a shorter run of the same scenario (CI)

Setup: a local redis-server; a Ray cluster of two nodes on 127.0.0.2 (:mod:`testkit.ray_cluster`):
node ``a`` (the head: room for 2 replicas, ``rp_replica=2``, cores 0 and 1 for them) and node
``b`` (room for 1, core 1); each replica's actor claims a free core set of its node. The updater
(``provider: ray``) runs in this process, outside any Ray job, connected to the cluster by
address; the router is a separate process. Replica ``r0`` prefers node ``a`` and ``r1`` node
``b`` (soft node affinity by label); each is one Ray actor (``max_restarts=0``) that runs a vLLM
CPU server of the marker checkpoints (generation g's checkpoint emits token T_g).

Phases, under continuous rollout load through the router (rolling.py's load: single requests and
3-request sessions; every rollout's tokens are checked against its bound generation's marker):

1. **placement**: both replicas placed, started and READY on g0 (``place_s``);
2. **rolling updates**: ``generations`` pushes, each rolled over both replicas;
3. **actor kill**: ``ray.kill`` on r1's actor; its leash takes the server down, the supervisor
   taints r1, the provider creates a fresh actor, recovery loads the latest generation from
   scratch (``actor_kill_recovery_s``: kill → READY on the latest generation, new process);
4. **node loss**: every process of node ``b`` is SIGKILLed (raylet, workers, r1's server); r1
   is tainted and placed again on node ``a``, which has room (``node_loss_recovery_s``), while
   r0 keeps serving (``min_admitting_replicas`` ≥ 1 throughout);
5. (``no_room``) node ``a`` is full now; a replica asking for more than any node has stays
   TAINTED with the placement error as its reason.

Checks: 0 cross-generation rollouts, 0 leaked bindings, at least one admitting replica at every
sample. Everything (Ray, vLLM, Redis, the router) is torn down in a ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from pool.launcher import ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaRecord, ReplicaState
from testkit.procs import bounded
from testkit.ray_cluster import RayCluster, RayNode
from testkit.redis_server import RedisServer, free_port
from testkit.scenarios import rolling
from updater.cycle import Deadlines
from updater.providers.base import PlacementError
from updater.providers.config import RayConfig, RayPlacement
from updater.providers.ray import RayProvider
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

S = ReplicaState
NAMESPACE = rolling.NAMESPACE  # the router started by rolling.start_router reads this one
PUSH_S = 330.0  # rolling.push gives up after 300 s; past this, something else hangs


@dataclass
class Params:
    generations: int = 2
    concurrency: int = 3
    session_share: float = 0.3
    max_tokens: int = 16
    steady_s: float = 3.0
    gap_s: float = 1.0
    node_loss: bool = True
    no_room: bool = True
    placement_timeout_s: float = 60.0
    recovery_timeout_s: float = 420.0

    def load(self) -> rolling.Params:
        return rolling.Params(
            concurrency=self.concurrency,
            session_share=self.session_share,
            max_tokens=self.max_tokens,
        )


def _placement(node: str) -> RayPlacement:
    # num_cpus=0: the custom resource rp_replica is what limits replicas per node
    return RayPlacement(num_cpus=0, resources={"rp_replica": 1}, prefer_node_labels={"rp": node})


async def _until(
    store: RedisStore, rid: str, ok: Any, timeout_s: float, what: str
) -> ReplicaRecord:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await store.replica(rid)
        if ok(rec):
            return rec
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid} not {what} after {timeout_s:g} s: {rec}")
        await asyncio.sleep(0.1)


async def _recovered(
    store: RedisStore, rid: str, old_process: str | None, t0: float, timeout_s: float
) -> dict[str, Any]:
    """Wait for ``rid`` to be taken out of service (TAINTED, maybe RECOVERING already), then
    READY on the latest generation as a new process."""
    tainted = await _until(store, rid, lambda r: r.state is not S.READY, 60, "out of service")
    tainted_s = time.monotonic() - t0
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await store.replica(rid)
        latest = await store.latest()
        if (
            rec.state is S.READY
            and latest is not None
            and rec.generation == latest[0].number
            and rec.process != old_process
        ):
            break
        if time.monotonic() > deadline:
            return {"recovered": False, "tainted_after_s": round(tainted_s, 2), "last": str(rec)}
        await asyncio.sleep(0.1)
    return {
        "recovered": True,
        "tainted_after_s": round(tainted_s, 2),
        "taint_reason": tainted.reason,
        "recovery_s": round(time.monotonic() - t0, 1),
        "generation": rec.generation,
        "url": rec.url,
        "process": rec.process,
    }


async def _node_of(provider: RayProvider, rid: str) -> str:
    info = await provider.locate(rid)
    return info.node


async def _no_room(cluster_address: str, base: Path) -> dict[str, Any]:
    """A replica asking for more than any node has: PlacementError with a clear reason, and no
    actor left behind."""
    want = RayPlacement(num_cpus=0, resources={"rp_replica": 5})
    cfg = ReplicaConfig(
        id="noroom", model=base, launch=ReplicaSpec(model=base, name="ray-noroom"), ray=want
    )
    ray_cfg = RayConfig(
        address=cluster_address, namespace=NAMESPACE, placement_timeout_s=5, call_timeout_s=3
    )
    provider = RayProvider(ray_cfg, [cfg])
    t0 = time.monotonic()
    try:
        await provider.start("noroom")
    except PlacementError as e:
        try:
            ray.get_actor(provider.actor_name("noroom"), namespace=NAMESPACE)
            left = True
        except ValueError:
            left = False
        return {
            "refused": True,
            "reason": e.message,
            "after_s": round(time.monotonic() - t0, 1),
            "actor_left": left,
        }
    await provider.stop("noroom")
    return {"refused": False}


async def scenario(p: Params, workdir: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    await asyncio.gather(*(asyncio.to_thread(rolling.marker, g) for g in range(p.generations + 3)))
    base = rolling.marker(0)
    cluster = RayCluster(workdir / "ray")
    redis: RedisServer | None = None
    store: RedisStore | None = None  # the scenario's reads (rolling.observer_store)
    updater_store: RedisStore | None = None
    up: Updater | None = None
    router: subprocess.Popen[bytes] | None = None
    run = rolling.Run()
    stop = asyncio.Event()
    bg: list[asyncio.Task[None]] = []
    result: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        cluster.start_head(
            # node a can host 2 replicas, on core 0 and (once node b is gone) core 1
            RayNode("a", 1, {"rp_replica": 2}, {"rp": "a"}, {"ROLLOUTPOOL_CPU_BIND": "0;1"})
        )
        cluster.add_node(
            RayNode("b", 1, {"rp_replica": 1}, {"rp": "b"}, {"ROLLOUTPOOL_CPU_BIND": "1"})
        )
        result["cluster_start_s"] = round(time.monotonic() - t0, 1)
        redis = RedisServer(workdir / "redis").start()
        store = rolling.observer_store(redis.url)
        updater_store = RedisStore.connect(StoreSettings(url=redis.url, namespace=NAMESPACE))
        replicas = [
            ReplicaConfig(
                id=f"r{i}",
                model=base,
                launch=ReplicaSpec(model=base, name=f"ray-r{i}", startup_timeout_s=240.0),
                ray=_placement(node),
            )
            for i, node in enumerate("ab")
        ]
        settings = UpdaterSettings(
            provider="ray",
            ray=RayConfig(
                address=cluster.address,
                namespace=NAMESPACE,
                placement_timeout_s=p.placement_timeout_s,
                call_timeout_s=5.0,
            ),
            replicas=replicas,
            health_interval_s=0.5,
            health_failures=2,
            health_timeout_s=2.0,
            deadlines=Deadlines(transfer_s=60.0),
        )
        up = Updater(settings, updater_store)
        provider = up.provider
        assert isinstance(provider, RayProvider)
        t0 = time.monotonic()
        async with bounded("placement", p.placement_timeout_s + p.recovery_timeout_s):
            await up.start()
        result["place_s"] = round(time.monotonic() - t0, 1)
        nodes = {n["NodeID"]: (n.get("Labels") or {}).get("rp") for n in ray.nodes() if n["Alive"]}
        placed = {rid: nodes.get(await _node_of(provider, rid)) for rid in ("r0", "r1")}
        result["placed_on"] = placed
        print(f"placed {placed} in {result['place_s']} s", flush=True)

        port = free_port()
        router = rolling.start_router(port, redis.url, 3.0)
        url = f"http://127.0.0.1:{port}"
        await rolling.wait_http(url + "/healthz")
        lp = p.load()
        bg = [
            asyncio.create_task(rolling.load(url, lp, run, stop, seed))
            for seed in range(p.concurrency)
        ]
        bg.append(asyncio.create_task(rolling.sampler(store, run, stop)))
        await asyncio.sleep(p.steady_s)

        g, updates = 1, []
        for _ in range(p.generations):
            t0 = time.monotonic()
            async with bounded(f"update to g{g}", PUSH_S):
                updates.append(await rolling.push(up, g))
            run.windows.append((t0, time.monotonic()))
            print(f"g{g}: {updates[-1]['state']}; rollouts so far {len(run.rollouts)}", flush=True)
            g += 1
            await asyncio.sleep(p.gap_s)
        result["updates"] = sum(1 for u in updates if u["state"] == "succeeded")

        # actor kill: Ray kills r1's actor; nothing else is touched
        before = await store.replica("r1")
        old_actor = await provider.incarnation("r1")
        served_before = len(run.rollouts)
        actor = ray.get_actor(provider.actor_name("r1"), namespace=NAMESPACE)
        t0 = time.monotonic()
        ray.kill(actor, no_restart=True)
        async with bounded("actor kill recovery", p.recovery_timeout_s + 90):
            kill = await _recovered(store, "r1", before.process, t0, p.recovery_timeout_s)
        kill["old_actor"] = old_actor
        kill["new_actor"] = await provider.incarnation("r1")
        kill["restarts"] = up.replicas["r1"].restarts
        kill["rollouts_meanwhile"] = len(run.rollouts) - served_before
        result["actor_kill"] = kill
        print(f"actor kill: {kill}", flush=True)

        if p.node_loss:
            before = await store.replica("r1")
            served_before = len(run.rollouts)
            t0 = time.monotonic()
            killed = cluster.kill_node("b")
            async with bounded("node loss recovery", p.recovery_timeout_s + 90):
                loss = await _recovered(store, "r1", before.process, t0, p.recovery_timeout_s)
            loss["processes_killed"] = len(killed)
            alive = {
                n["NodeID"]: (n.get("Labels") or {}).get("rp") for n in ray.nodes() if n["Alive"]
            }
            loss["nodes_alive"] = sorted(v for v in alive.values() if v)
            if loss["recovered"]:
                loss["placed_on"] = alive.get(await _node_of(provider, "r1"))
            loss["rollouts_meanwhile"] = len(run.rollouts) - served_before
            result["node_loss"] = loss
            print(f"node loss: {loss}", flush=True)
            # one more update with r1 on its new node
            async with bounded(f"update to g{g} after the node loss", PUSH_S):
                updates.append(await rolling.push(up, g))
            result["update_after_node_loss"] = updates[-1]["state"]
            g += 1

        stop.set()
        async with bounded("the load's end", 150):
            await asyncio.gather(*bg)
        bg = []
        if p.no_room:
            async with bounded("the no-room placement", 120):
                result["no_room"] = await _no_room(cluster.address, base)
        await asyncio.sleep(4)  # let the router's reaper settle anything left
        bad = rolling.cross_generation(run.rollouts)
        result.update(
            {
                "nodes": 2,
                "replicas": 2,
                "rollouts": len(run.rollouts),
                "rollouts_by_kind": {
                    k: sum(1 for r in run.rollouts if r.kind == k) for k in ("single", "session")
                },
                "generations_served": sorted({r.generation for r in run.rollouts}),
                "cross_generation": len(bad),
                "cross_generation_ids": bad[:10],
                "min_admitting_replicas": run.min_admitting,
                "admitting_samples": run.samples,
                "client_errors": run.errors,
                "leaked_bindings": sum(r.active for r in await store.replicas()),
                "actor_kill_recovered": bool(result["actor_kill"]["recovered"]),
                "actor_kill_recovery_s": result["actor_kill"].get("recovery_s"),
                "node_loss_handled": bool(result.get("node_loss", {}).get("recovered")),
                "node_loss_recovery_s": result.get("node_loss", {}).get("recovery_s"),
                "wall_s": round(time.monotonic() - t_start, 1),
                "params": p.__dict__,
            }
        )
        return result
    finally:
        stop.set()
        for t in bg:
            t.cancel()
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(10)
        if up is not None:
            with contextlib.suppress(Exception):
                await up.stop()
        if updater_store is not None:
            await updater_store.close()
        if store is not None:
            await store.close()
        if redis is not None:
            redis.stop()
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.stop()
