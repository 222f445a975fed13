"""Rolling updates under load on real vLLM CPU replicas, with faults and a negative control.

    python -m bench.rolling_update_cpu [--rollouts 1000] [--generations 6]

Setup: a local redis-server; 2 vLLM CPU replicas serving *marker* checkpoints (generation g's
checkpoint emits token T_g for any prompt, greedy or sampled); the updater in this process
(replica r1 reached through a fault-injecting proxy); the router as a separate process
(``python -m router``). A load generator sends rollouts continuously through the router —
single requests and 3-request sessions, temperature 1.0 — while the updater publishes
generations. Afterwards every rollout's tokens are checked against its bound generation's
marker: one foreign token makes it ``cross_generation``.

Also measured, in the same run:

* ``min_admitting_replicas``: sampled every 50 ms from the store (READY on the published
  generation), must never be 0;
* ``throughput_ratio_during_update``: completed rollouts/s inside update windows over the rate
  outside them;
* ``faults.stuck_transfer``: the proxy holds r1's ``/collective_rpc`` forever; the updater's
  watchdog must taint r1 within the transfer deadline, r0 keeps serving, r1 is restarted and
  rejoins at the latest generation (``tainted_after_s``: UPDATING to TAINTED in Redis time;
  ``transfer_phase_s``: the updater's transfer phase, which ends at the deadline, late by the
  few statements around the wait plus at most ``stalled_s``, how long this process's loop could
  not run meanwhile);
* ``faults.router_kill``: a second router process is SIGKILLed with rollouts in flight; their
  bindings must be aborted by the surviving router's reaper (``orphans_left`` must be 0);
* ``unsafe_keep_mode``: the negative control — 32 concurrent rollouts straight to a replica,
  ``pause?mode=keep`` → ``reload_weights`` → ``resume`` with no drain: rollouts that contain
  two markers show the check can fail.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pool.engine import VllmEngine
from pool.launcher import ReplicaSpec, count_launches
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.fault_proxy import FaultProxy
from testkit.harness import local_launcher
from testkit.loop_stalls import LoopStalls
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from updater.api import ProbeSpec, UpdateRequest
from updater.cycle import Deadlines
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

S = ReplicaState
PROBE_PROMPT = list(range(10, 26))
NAMESPACE = "rolling"


# A CPU replica starts in 20-60 s here, but a restart during the stuck-transfer fault, with r0
# under full rollout load, is CPU-starved: 60-150 s (bench/results/restart_under_load.json).
# The launcher fails a start only after 240 s *and* 60 s without progress (CPU or log), so a
# slow restart is not killed halfway; the recovery wait below still leaves room for a retry
# by the updater's supervisor. ``r1_launches`` reports the tries.
STARTUP_TIMEOUT_S = 240.0


@dataclass
class Params:
    rollouts: int = 1000
    generations: int = 6
    concurrency: int = 6
    session_share: float = 0.3
    max_tokens: int = 24
    steady_s: float = 8.0
    gap_s: float = 3.0
    transfer_deadline_s: float = 3.0
    stuck_transfer: bool = True
    router_kill: bool = True
    negative_control: bool = True


@dataclass
class Rollout:
    id: str
    kind: str
    generation: int
    tokens: list[int]
    t_end: float


@dataclass
class Run:
    rollouts: list[Rollout] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    min_admitting: int = 99
    samples: int = 0
    windows: list[tuple[float, float]] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def marker(g: int) -> Path:
    return ensure_model("marker", token_id=marker_token(g))


def start_router(
    port: int, redis_url: str, lease_s: float, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        {
            "ROLLOUTPOOL_ROUTER_PORT": str(port),
            "ROLLOUTPOOL_ROUTER_ADMISSION_WAIT_S": "15",
            "ROLLOUTPOOL_ROUTER_REQUEST_LEASE_S": str(lease_s),
            "ROLLOUTPOOL_ROUTER_SESSION_LEASE_S": str(lease_s * 2),
            "ROLLOUTPOOL_ROUTER_REAPER_INTERVAL_S": "0.5",
            "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
            "ROLLOUTPOOL_REDIS_URL": redis_url,
            "ROLLOUTPOOL_REDIS_NAMESPACE": NAMESPACE,
            **(extra_env or {}),
        }
    )
    return subprocess.Popen([sys.executable, "-m", "router"], env=env, start_new_session=True)


async def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(url, timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


# ------------------------------------------------------------------ load


async def single(http: httpx.AsyncClient, rng: random.Random, p: Params, run: Run) -> None:
    body = {
        "model": "rolloutpool",
        "prompt": [rng.randrange(3, 2000) for _ in range(8)],
        "max_tokens": p.max_tokens,
        "temperature": 1.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = await http.post("/v1/completions", json=body)
    if r.status_code != 200:
        run.error(f"single {r.status_code}")
        return
    data = r.json()
    run.rollouts.append(
        Rollout(
            data["rollout"]["id"],
            "single",
            int(data["rollout"]["generation"]),
            data["choices"][0]["token_ids"],
            time.monotonic(),
        )
    )


async def session(http: httpx.AsyncClient, rng: random.Random, p: Params, run: Run) -> None:
    r = await http.post("/v1/rollouts", json={})
    if r.status_code != 201:
        run.error(f"session-open {r.status_code}")
        return
    s = r.json()
    rid, tokens = s["rollout_id"], []
    try:
        for _ in range(3):
            body = {
                "model": "rolloutpool",
                "prompt": [rng.randrange(3, 2000) for _ in range(8)],
                "max_tokens": p.max_tokens // 2,
                "temperature": 1.0,
                "return_token_ids": True,
                "ignore_eos": True,
            }
            t = await http.post("/v1/completions", json=body, headers={"X-Rollout-Id": rid})
            if t.status_code != 200:
                run.error(f"session-turn {t.status_code}")
                return
            data = t.json()
            assert int(data["rollout"]["generation"]) == int(s["generation"])
            tokens += data["choices"][0]["token_ids"]
    finally:
        await http.post(f"/v1/rollouts/{rid}/close")
    run.rollouts.append(Rollout(rid, "session", int(s["generation"]), tokens, time.monotonic()))


async def load(url: str, p: Params, run: Run, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            try:
                if rng.random() < p.session_share:
                    await session(http, rng, p, run)
                else:
                    await single(http, rng, p, run)
            except httpx.HTTPError as e:
                run.error(type(e).__name__)
                await asyncio.sleep(0.1)


#: How long the scenario's own reads (sampling, waiting for a state) wait for Redis. The scenario
#: observes; on a saturated host Redis can answer later than the product's 2 s socket timeout,
#: and an observer that gave up would fail the run for nothing the product did. The updater and
#: the router keep their own clients with the product's defaults.
OBSERVER_SOCKET_TIMEOUT_S = 60.0


def observer_store(redis_url: str, namespace: str = NAMESPACE) -> RedisStore:
    """A client of a scenario's namespace for the scenario's own reads (see
    :data:`OBSERVER_SOCKET_TIMEOUT_S`); the caller closes it."""
    settings = StoreSettings(
        url=redis_url, namespace=namespace, socket_timeout_s=OBSERVER_SOCKET_TIMEOUT_S
    )
    return RedisStore.connect(settings)


async def sampler(store: RedisStore, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        latest = await store.latest()
        recs = await store.replicas()
        if latest is not None:
            n = sum(1 for r in recs if r.state is S.READY and r.generation == latest[0].number)
            run.min_admitting = min(run.min_admitting, n)
            run.samples += 1
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ phases


async def push(up: Updater, g: int, timeout_s: float = 300) -> dict[str, Any]:
    tok = marker_token(g)
    rec = await up.submit(
        UpdateRequest(
            checkpoint=str(marker(g)),
            step=g,
            trainer_run="rolling-bench",
            probe=ProbeSpec(prompt_token_ids=PROBE_PROMPT, expected_token_ids=[tok] * 4),
        )
    )
    deadline, cur = time.monotonic() + timeout_s, rec
    while time.monotonic() < deadline:
        cur = await up.get(rec.id)
        if cur.state.value in ("succeeded", "failed", "superseded"):
            return cur.model_dump(mode="json")
        await asyncio.sleep(0.05)
    replicas = {
        r.replica_id: (r.state.value, r.generation, r.busy) for r in await up.store.replicas()
    }
    raise TimeoutError(  # what the update and the replicas were doing, for the failure report
        f"update to g{g}: {cur.model_dump_json(include={'state', 'error', 'replicas'})}; "
        f"replicas (state, generation, busy): {replicas}"
    )


async def stuck_transfer(
    up: Updater, proxy: FaultProxy, store: RedisStore, g: int, p: Params
) -> dict[str, Any]:
    """Hold r1's /collective_rpc forever during the next update; measure taint and recovery."""
    launcher = local_launcher(up, "r1")
    while (await store.replica("r1")).state is not S.READY:  # an earlier recovery may still run
        await asyncio.sleep(0.2)
    normal = up.runner.deadlines
    # only while the fault is injected: a tight transfer deadline (ordinary reloads get the
    # normal one, so a busy machine cannot turn a slow reload into a false "stuck" result)
    up.runner.deadlines = normal.model_copy(update={"transfer_s": p.transfer_deadline_s})
    proxy.hang_paths.add("/collective_rpc")
    t0 = time.monotonic()
    try:
        async with LoopStalls() as stalls:  # the updater runs on this loop
            rec = await push(up, g)
    finally:
        proxy.hang_paths.clear()  # the restarted server must be reachable again for recovery
        up.runner.deadlines = normal
    entries = await store.journal()
    upd = [
        e
        for e in entries
        if e.type == "transition"
        and e.fields.get("replica") == "r1"
        and e.fields.get("to") == "UPDATING"
    ]
    taint = [
        e
        for e in entries
        if e.type == "transition"
        and e.fields.get("replica") == "r1"
        and e.fields.get("to") == "TAINTED"
    ]
    tainted_after = (
        (int(taint[-1].fields["ts"]) - int(upd[-1].fields["ts"])) / 1000 if upd and taint else None
    )
    recovered = False
    while time.monotonic() - t0 < 600:  # room for a stalled start (STARTUP_TIMEOUT_S) + retries
        r1 = await store.replica("r1")
        latest = await store.latest()
        if r1.state is S.READY and latest is not None and r1.generation == latest[0].number:
            recovered = True
            break
        await asyncio.sleep(0.2)
    return {
        "deadline_s": p.transfer_deadline_s,
        "tainted_after_s": tainted_after,
        "transfer_phase_s": rec["replicas"].get("r1", {}).get("phases", {}).get("transfer"),
        "stalled_s": round(stalls.stalled_s, 2),
        "recovered": recovered,
        "recovered_after_s": round(time.monotonic() - t0, 1),
        "held_calls": proxy.held,
        "update_state": rec["state"],
        "r1_outcome": rec["replicas"].get("r1", {}).get("outcome"),
        "r1_launches": count_launches(launcher.log_path),
    }


async def router_kill(redis_url: str, store: RedisStore, lease_s: float) -> dict[str, Any]:
    """SIGKILL a router with rollouts in flight; its bindings must not be left behind."""
    port = free_port()
    proc = start_router(port, redis_url, lease_s)
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/healthz")
    ids: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(3):
            r = await http.post("/v1/rollouts", json={})
            ids.append(r.json()["rollout_id"])
        body = {
            "model": "rolloutpool",
            "prompt": [5, 6, 7],
            "max_tokens": 400,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        inflight = [
            asyncio.create_task(
                http.post("/v1/completions", json=body, headers={"X-Rollout-Id": i})
            )
            for i in ids
        ]
        inflight += [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
        await asyncio.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        await asyncio.gather(*inflight, return_exceptions=True)
    t_kill = time.monotonic()
    # the surviving router's reaper aborts them once their leases expire
    await asyncio.sleep(lease_s * 2 + 2)
    states = [(await store.binding(i)).state.value for i in ids]
    return {
        "sessions_in_flight": len(ids),
        "singles_in_flight": 3,
        "session_states_after": states,
        "orphans_left": sum(1 for s in states if s == "active"),
        "checked_after_s": round(time.monotonic() - t_kill, 1),
    }


async def unsafe_keep_mode(
    url: str, g_from: int, g_to: int, n: int = 32, attempts: int = 10
) -> dict[str, Any]:
    """Negative control: pause(keep) + reload + resume with rollouts in flight, no drain.

    Each attempt starts ``n`` long rollouts and pauses as soon as the server reports one
    running. The window is timing-dependent: on a busy 2-core box the control calls
    (``/metrics``, ``/pause``, through the client that also sends the rollouts) come back
    seconds late (``bench/control_latency.py``), so the pause often lands after the rollouts
    finished (measured: about half the attempts show no mixing). Up to ``attempts`` attempts
    run, alternating between the two markers, until one shows mixing; the replica ends on
    ``g_to`` or ``g_from`` (``on_generation``) and the attempts made are reported.
    """
    eng = VllmEngine(url, timeout=120)
    await eng.bootstrap()
    mixed = made = running = 0
    on, to = g_from, g_to
    try:
        for made in range(1, attempts + 1):  # noqa: B007 (reported below)
            old, new = marker_token(on), marker_token(to)
            tasks = [
                asyncio.create_task(
                    eng.complete([3 + i, 4, 5], max_tokens=480, temperature=1.0, timeout_s=120)
                )
                for i in range(n)
            ]
            deadline = time.monotonic() + 30
            running = 0
            while running < 1 and time.monotonic() < deadline:
                running = (await eng.metrics()).requests_running
            await eng.pause("keep")
            await eng.collective_rpc("reload_weights", {"weights_path": str(marker(to))})
            await eng.resume()
            outs = await asyncio.gather(*tasks)
            mixed = sum(1 for o in outs if old in o and new in o)
            on, to = to, on
            if mixed:
                break
    finally:
        await eng.aclose()
    return {"rollouts": n, "attempts": made, "cross_generation": mixed, "on_generation": on}


def cross_generation(rollouts: list[Rollout]) -> list[str]:
    return [r.id for r in rollouts if any(t != marker_token(r.generation) for t in r.tokens)]


def throughput_ratio(run: Run, t_from: float, t_to: float) -> float | None:
    inside = outside = 0
    t_in = sum(min(b, t_to) - max(a, t_from) for a, b in run.windows if b > t_from and a < t_to)
    for r in run.rollouts:
        if not t_from <= r.t_end <= t_to:
            continue
        if any(a <= r.t_end <= b for a, b in run.windows):
            inside += 1
        else:
            outside += 1
    t_out = (t_to - t_from) - t_in
    if t_in <= 0 or t_out <= 0 or outside == 0:
        return None
    return round((inside / t_in) / (outside / t_out), 3)


async def scenario(p: Params, workdir: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    lease_s = 3.0
    extra = int(p.stuck_transfer) + 2
    await asyncio.gather(*(asyncio.to_thread(marker, g) for g in range(p.generations + extra)))
    redis = RedisServer(workdir / "redis").start()
    store = observer_store(redis.url)
    updater_store = RedisStore.connect(StoreSettings(url=redis.url, namespace=NAMESPACE))
    r1_port = free_port()
    proxy = await FaultProxy(f"http://127.0.0.1:{r1_port}").start()
    base = marker(0)
    replicas = [
        ReplicaConfig(
            id="r0",
            model=base,
            launch=ReplicaSpec(
                model=base,
                name="roll-r0",
                cpu_bind="0",
                work_dir=workdir / "r0",
                startup_timeout_s=STARTUP_TIMEOUT_S,
            ),
        ),
        ReplicaConfig(
            id="r1",
            model=base,
            url=proxy.url,
            launch=ReplicaSpec(
                model=base,
                name="roll-r1",
                cpu_bind="1",
                port=r1_port,
                work_dir=workdir / "r1",
                startup_timeout_s=STARTUP_TIMEOUT_S,
            ),
        ),
    ]
    settings = UpdaterSettings(
        replicas=replicas,
        health_interval_s=0.5,
        health_failures=3,
        deadlines=Deadlines(transfer_s=60.0),
    )
    up = Updater(settings, updater_store)
    routers: list[subprocess.Popen[bytes]] = []
    run = Run()
    stop = asyncio.Event()
    result: dict[str, Any] = {}
    try:
        await up.start()
        port = free_port()
        routers.append(start_router(port, redis.url, lease_s))
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/healthz")
        bg = [asyncio.create_task(load(url, p, run, stop, seed)) for seed in range(p.concurrency)]
        bg.append(asyncio.create_task(sampler(store, run, stop)))
        t_load = time.monotonic()
        await asyncio.sleep(p.steady_s)
        updates = []
        g = 1
        while g <= p.generations or len(run.rollouts) < p.rollouts:
            t0 = time.monotonic()
            updates.append(await push(up, g))
            run.windows.append((t0, time.monotonic()))
            print(f"g{g}: {updates[-1]['state']} rollouts so far {len(run.rollouts)}", flush=True)
            g += 1
            await asyncio.sleep(p.gap_s)
            if g > 60:
                break
        t_updates_end = time.monotonic()
        faults: dict[str, Any] = {}
        if p.stuck_transfer:
            faults["stuck_transfer"] = await stuck_transfer(up, proxy, store, g, p)
            print(f"stuck transfer: {faults['stuck_transfer']}", flush=True)
            g += 1
        if p.router_kill:
            faults["router_kill"] = await router_kill(redis.url, store, lease_s)
            print(f"router kill: {faults['router_kill']}", flush=True)
        stop.set()
        await asyncio.gather(*bg)
        await asyncio.sleep(lease_s + 1)  # let the reaper settle anything left
        leaked = sum(r.active for r in await store.replicas())
        bad = cross_generation(run.rollouts)
        result = {
            "rollouts": len(run.rollouts),
            "rollouts_by_kind": {
                k: sum(1 for r in run.rollouts if r.kind == k) for k in ("single", "session")
            },
            "updates": sum(1 for u in updates if u["state"] == "succeeded"),
            "generations_published": sorted({r.generation for r in run.rollouts}),
            "cross_generation": len(bad),
            "cross_generation_ids": bad[:10],
            "min_admitting_replicas": run.min_admitting,
            "admitting_samples": run.samples,
            "throughput_ratio_during_update": throughput_ratio(run, t_load, t_updates_end),
            "update_windows_s": [round(b - a, 3) for a, b in run.windows],
            "client_errors": run.errors,
            "leaked_bindings": leaked,
            "faults": faults,
        }
        if p.negative_control:
            rec = await store.replica("r0")
            result["unsafe_keep_mode"] = await unsafe_keep_mode(
                rec.url, int(rec.generation or 0), g + 1
            )
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        result["params"] = p.__dict__
        return result
    finally:
        stop.set()
        for proc in routers:
            terminate(proc)
        await up.stop()
        await updater_store.close()
        await store.close()
        await proxy.stop()
        redis.stop()
