"""The pool at scale on stand-in replicas: one Redis, R router processes, one updater process,
N stand-in vLLM replicas in one process (``bench/scale.py``, ``tests/integration/test_scale.py``).

Processes (all real but the replicas): a local ``redis-server``; ``python -m testkit.standin``
serving N replicas of the *marker* checkpoint of generation 0 (generation g's checkpoint emits
token T_g for any prompt, greedy or sampled, as the real model does); ``python -m updater``
with those N replicas as ``external`` replicas (``max_unavailable`` k, ``min_serving`` N-k);
R ``python -m router`` processes. ``max_staleness`` is 1 on both: with 0, publishing g+1 closes
admissions on every replica still on g, so capacity during a roll is by design only the
replicas already on g+1 (strictness is per binding either way: a rollout runs on the one
generation it was bound to).

Phases of :func:`scenario` (this process is the client; its load goes round-robin over the
routers, closed loop, ``concurrency`` workers):

1. **idle** (``idle_s``, after ``settle_s`` for the routers to take their grants): Redis
   commands/s (``INFO commandstats``: scripts' own commands included) and CPU with no load:
   the background (routers' heartbeats, which carry the pool view's version, and reapers; the
   updater's lease and health loop). The view itself comes by change feed, so none of it
   should grow with N.
2. **steady** (``steady_s``): single-request rollouts only, no update. Measured: rollouts/s,
   the routers' CPU (``/proc``, :func:`bench._proc`-style schedstat sums) per 1,000 rollouts,
   Redis CPU (``INFO cpu``) and commands (``INFO commandstats``, which counts the commands
   scripts run as well) per rollout, and the router's added latency (the ``router`` part of
   its ``Server-Timing`` header: everything in the handler but the upstream call).
3. **monitor** (``monitor_s``): the same load under ``MONITOR``, to count the commands clients
   *send* per rollout, by name and kind (a script's own commands are marked ``lua``).
4. **roll** : mixed load (``session_share`` of the rollouts are ``session_turns``-request
   sessions) while ``updates`` generations are pushed through the updater's HTTP API one after
   another; admitting capacity (READY replicas within ``max_staleness`` of the published
   generation, over N) is sampled every ``sample_s``.
5. **memory**: load stopped, ``memory_sessions`` sessions opened (at most half the pool's
   capacity): Redis ``used_memory_dataset`` (``used_memory`` less the overhead: client buffers,
   the AOF buffer, which the routers' pipelined reads make jitter by hundreds of KB) before and
   after, over the number opened, is the memory per active binding.
6. **audit**: every rollout's tokens against its bound generation's marker
   (``cross_generation``), Redis's leases and active sets once the load stopped
   (``leaked_bindings``), and every replica's generation.

Everything started is stopped on the way out (``testkit.procs.terminate``), also on failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml

from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from testkit.stats import pct

S = ReplicaState
NAMESPACE = "scale"
ADMIN = "scale-bench-admin-7f3a"
PROBE_PROMPT = list(range(10, 26))
#: generation g serves the marker checkpoint of ``g % MARKERS`` (consecutive ones differ)
MARKERS = 6
CLK = 1e9  # schedstat nanoseconds


@dataclass
class Params:
    replicas: int = 16
    routers: int = 2
    k: int = 4
    updates: int = 5
    concurrency: int = 24
    session_share: float = 0.25
    session_turns: int = 2
    max_tokens: int = 16
    request_tps: float = 400.0  # tokens/s per request: 16 tokens in 40 ms
    transfer_s: float = 0.5  # reload_weights seconds on a stand-in
    capacity: int = 64
    idle_s: float = 5.0
    settle_s: float = 5.0
    steady_s: float = 8.0
    monitor_s: float = 2.0
    sample_s: float = 0.1
    max_staleness: int = 1
    memory_sessions: int = 1000
    lease_s: float = 10.0
    health_interval_s: float = 2.0
    update_timeout_s: float = 600.0


def marker_model(g: int) -> Path:
    return ensure_model("marker", token_id=marker_token(g % MARKERS))


@dataclass
class Rollout:
    id: str
    kind: str
    generation: int
    tokens: set[int]
    router_ms: float | None
    t_end: float


@dataclass
class Load:
    """What the clients saw, and the switches that steer them."""

    rollouts: list[Rollout] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    session_share: float = 0.0
    stop: asyncio.Event = field(default_factory=asyncio.Event)


# ------------------------------------------------------------------------------ processes


def _cpu_s(pid: int) -> float:
    """CPU seconds of all threads of ``pid`` (schedstat)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
        except OSError:
            continue
    return total / CLK


async def _wait_http(http: aiohttp.ClientSession, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s} s")


def _spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip


@dataclass
class Stack:
    """The processes of one configuration (started by :func:`start_stack`)."""

    redis: RedisServer
    standin: subprocess.Popen[bytes]
    updater: subprocess.Popen[bytes]
    routers: list[subprocess.Popen[bytes]]
    router_urls: list[str]
    updater_url: str
    standin_admin: str

    def stop(self) -> None:
        for p in [*self.routers, self.updater, self.standin]:
            terminate(p)
        self.redis.stop()


async def start_stack(p: Params, work: Path, http: aiohttp.ClientSession) -> Stack:
    """Start Redis, the stand-ins, the updater and the routers; return once all answer (the
    updater once it bootstrapped every replica). On failure what was started is stopped."""
    redis = RedisServer(work / "redis").start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        base = await asyncio.to_thread(marker_model, 0)
        urls_file = work / "standins.json"
        standin = _spawn(
            [sys.executable, "-m", "testkit.standin", "--count", str(p.replicas),
             "--model", str(base), "--admin-port", "0", "--urls-file", str(urls_file),
             "--request-tps", str(p.request_tps), "--transfer-s", str(p.transfer_s)],
            work / "standin.log",
        )  # fmt: skip
        procs.append(standin)
        deadline = time.monotonic() + 120
        while not urls_file.exists():
            if standin.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stand-ins did not start: {_tail(work / 'standin.log')}")
            await asyncio.sleep(0.1)
        doc = json.loads(urls_file.read_text())
        up_port = free_port()
        config = {
            "updater": {
                "port": up_port,
                "admin_token": ADMIN,
                "replicas": [
                    {"id": f"s{i:03d}", "url": u, "model": str(base), "capacity": p.capacity}
                    for i, u in enumerate(doc["urls"])
                ],
                "max_unavailable": p.k,
                "min_serving": max(0, p.replicas - p.k),
                "max_staleness": p.max_staleness,
                "drain_timeout_s": 30.0,
                "health_interval_s": p.health_interval_s,
                "health_failures": 3,
            },
            "redis": {"url": redis.url, "namespace": NAMESPACE},
        }
        (work / "updater.yaml").write_text(yaml.safe_dump(config))
        updater = _spawn(
            [sys.executable, "-m", "updater", "--config", str(work / "updater.yaml")],
            work / "updater.log",
        )
        procs.append(updater)
        router_urls = []
        for i in range(p.routers):
            port = free_port()
            env = {
                "ROLLOUTPOOL_ROUTER_PORT": str(port),
                "ROLLOUTPOOL_ROUTER_ADMISSION_WAIT_S": "15",
                "ROLLOUTPOOL_ROUTER_REQUEST_LEASE_S": str(p.lease_s),
                "ROLLOUTPOOL_ROUTER_SESSION_LEASE_S": str(p.lease_s * 2),
                "ROLLOUTPOOL_ROUTER_REAPER_INTERVAL_S": "1",
                "ROLLOUTPOOL_ROUTER_MAX_STALENESS": str(p.max_staleness),
                "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
                "ROLLOUTPOOL_REDIS_URL": redis.url,
                "ROLLOUTPOOL_REDIS_NAMESPACE": NAMESPACE,
            }
            procs.append(_spawn([sys.executable, "-m", "router"], work / f"router{i}.log", env))
            router_urls.append(f"http://127.0.0.1:{port}")
        updater_url = f"http://127.0.0.1:{up_port}"
        for url in [*router_urls, updater_url]:
            await _wait_http(http, url + "/healthz", 300)
        return Stack(redis, standin, updater, procs[2:], router_urls, updater_url, doc["admin"])
    except BaseException:
        for proc in procs:
            terminate(proc)
        redis.stop()
        raise


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


# ------------------------------------------------------------------------------ load


def _body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "rolloutpool",
        "prompt": [rng.randrange(3, 2000) for _ in range(8)],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }


def _router_ms(header: str) -> float | None:
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "router" and dur:
            return float(dur)
    return None


async def _single(
    http: aiohttp.ClientSession, url: str, rng: random.Random, p: Params, load: Load
) -> None:
    async with http.post(url + "/v1/completions", json=_body(rng, p.max_tokens)) as r:
        data = await r.json(content_type=None)
        load.statuses[f"single {r.status}"] += 1
        if r.status != 200:
            return
        ro = data["rollout"]
        load.rollouts.append(
            Rollout(ro["id"], "single", int(ro["generation"]), set(data["choices"][0]["token_ids"]),
                    _router_ms(r.headers.get("Server-Timing", "")), time.monotonic())
        )  # fmt: skip


async def _session(
    http: aiohttp.ClientSession, url: str, rng: random.Random, p: Params, load: Load
) -> None:
    async with http.post(url + "/v1/rollouts", json={}) as r:
        load.statuses[f"session-open {r.status}"] += 1
        if r.status != 201:
            return
        s = await r.json()
    rid, tokens = s["rollout_id"], set()
    try:
        for _ in range(p.session_turns):
            headers = {"X-Rollout-Id": rid}
            body = _body(rng, p.max_tokens // 2)
            async with http.post(url + "/v1/completions", json=body, headers=headers) as t:
                data = await t.json(content_type=None)
                load.statuses[f"session-turn {t.status}"] += 1
                if t.status != 200:
                    return
                if int(data["rollout"]["generation"]) != int(s["generation"]):
                    load.statuses["session generation changed"] += 1  # counted, and a failure
                tokens |= set(data["choices"][0]["token_ids"])
    finally:
        async with http.post(f"{url}/v1/rollouts/{rid}/close") as c:
            load.statuses[f"session-close {c.status}"] += 1
    load.rollouts.append(
        Rollout(rid, "session", int(s["generation"]), tokens, None, time.monotonic())
    )


async def worker(
    http: aiohttp.ClientSession, urls: list[str], p: Params, load: Load, seed: int
) -> None:
    rng = random.Random(seed)
    i = seed
    while not load.stop.is_set():
        i += 1
        url = urls[i % len(urls)]
        try:
            if rng.random() < load.session_share:
                await _session(http, url, rng, p, load)
            else:
                await _single(http, url, rng, p, load)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            load.statuses[type(e).__name__] += 1
            await asyncio.sleep(0.1)


# ------------------------------------------------------------------------------ measuring


async def _redis_counters(r: aioredis.Redis) -> tuple[float, dict[str, tuple[int, int]], int]:
    """(Redis CPU seconds, (calls, microseconds) per command, total commands processed)."""
    cpu = await r.info("cpu")
    stats = await r.info("commandstats")
    calls = {
        k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()
    }
    total = (await r.info("stats"))["total_commands_processed"]
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), calls, int(total)


async def _monitor(url: str, seconds: float) -> tuple[Counter[str], Counter[str]]:
    """Commands clients sent and commands scripts ran over ``seconds``, by name (``MONITOR``)."""
    sent: Counter[str] = Counter()
    scripted: Counter[str] = Counter()
    r = aioredis.Redis.from_url(url)
    try:
        async with r.monitor() as m:
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                try:
                    ev = await asyncio.wait_for(m.next_command(), left)
                except TimeoutError:
                    break
                name = str(ev["command"]).split(" ", 1)[0].strip('"').lower()
                (scripted if ev.get("client_type") == "lua" else sent)[name] += 1
    finally:
        await r.aclose()
    return sent, scripted


async def _sampler(
    store: RedisStore, p: Params, out: list[tuple[float, float]], stop: asyncio.Event
) -> None:
    """(wall ms, admitting fraction of N) every ``sample_s``."""
    while not stop.is_set():
        recs, latest = await asyncio.gather(store.replicas(), store.latest())
        if latest is not None:
            g = latest[0].number
            n = sum(1 for x in recs if x.state is S.READY and x.generation is not None
                    and x.generation >= g - p.max_staleness)  # fmt: skip
            out.append((time.time() * 1000, n / p.replicas))
        await asyncio.sleep(p.sample_s)


class _Window:
    """Counters at the start of a measuring window; :meth:`end` turns them into rates."""

    def __init__(self, r: aioredis.Redis, stack: Stack, load: Load) -> None:
        self.r, self.stack, self.load = r, stack, load

    async def begin(self) -> _Window:
        self.t = time.monotonic()
        self.n = len(self.load.rollouts)
        self.procs = self._procs()
        self.redis = await _redis_counters(self.r)
        return self

    def _procs(self) -> dict[str, float]:
        s = self.stack
        out = {"routers": sum(_cpu_s(x.pid) for x in s.routers)}
        out |= {"updater": _cpu_s(s.updater.pid), "standins": _cpu_s(s.standin.pid)}
        out |= {"redis": _cpu_s(s.redis.proc.pid) if s.redis.proc else 0.0}
        return out | {"client": _cpu_s(os.getpid())}

    async def end(self) -> dict[str, Any]:
        cpu1, calls1, total1 = await _redis_counters(self.r)
        cpu0, calls0, total0 = self.redis
        wall = time.monotonic() - self.t
        procs = {k: v - self.procs[k] for k, v in self._procs().items()}
        calls = {
            k: (c - calls0.get(k, (0, 0))[0], u - calls0.get(k, (0, 0))[1])
            for k, (c, u) in calls1.items()
            if c - calls0.get(k, (0, 0))[0]
        }
        return {
            "wall_s": wall,
            "rollouts": len(self.load.rollouts) - self.n,
            "rollouts_list": self.load.rollouts[self.n :],
            "redis_cpu_s": cpu1 - cpu0,
            "redis_calls": calls,
            "redis_commands": total1 - total0,
            "cores": {k: round(v / wall, 3) for k, v in procs.items()},
            "cpu_s": procs,
        }


async def push(http: aiohttp.ClientSession, stack: Stack, n: int, p: Params) -> dict[str, Any]:
    """Push marker checkpoint ``n`` and wait for its update record to be final."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    body = {
        "checkpoint": str(marker_model(n)),
        "step": n,
        "trainer_run": "scale",
        "probe": {
            "prompt_token_ids": PROBE_PROMPT,
            "expected_token_ids": [marker_token(n % MARKERS)] * 4,
        },
    }
    async with http.post(stack.updater_url + "/v1/updates", json=body, headers=headers) as r:
        rec = await r.json()
        if r.status != 202:
            raise RuntimeError(f"push {n}: {r.status} {rec}")
    deadline = time.monotonic() + p.update_timeout_s
    while time.monotonic() < deadline:
        async with http.get(f"{stack.updater_url}/v1/updates/{rec['id']}", headers=headers) as r:
            rec = await r.json()
        if rec["state"] in ("succeeded", "failed", "superseded"):
            return dict(rec)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"update {rec['id']} did not end within {p.update_timeout_s} s")


def _update_row(
    rec: dict[str, Any], samples: list[tuple[float, float]], p: Params
) -> dict[str, Any]:
    windows = [
        rep.get("phases", {}).get("drain", 0.0) + (rep.get("window_s") or 0.0)
        for rep in rec["replicas"].values()
        if rep.get("outcome") == "ready"
    ]
    phases: dict[str, list[float]] = {}
    for rep in rec["replicas"].values():
        for name, secs in rep.get("phases", {}).items():
            phases.setdefault(name, []).append(secs)
    start, end = rec.get("started_ms"), rec.get("rolled_ms")
    during = [f for t, f in samples if start and end and start <= t <= end]
    outcomes = Counter(str(rep.get("outcome")) for rep in rec["replicas"].values())
    reasons = Counter(
        str(rep.get("reason", ""))[:160]
        for rep in rec["replicas"].values()
        if rep.get("outcome") not in ("ready", None)
    )
    roll_s = (end - start) / 1000 if start and end else None
    window = statistics.median(windows) if windows else None
    return {
        "generation": rec["generation"],
        "state": rec["state"],
        "replicas_updated": len(windows),
        "outcomes": dict(outcomes),
        "reasons_not_ready": dict(reasons.most_common(5)),
        "roll_s": roll_s,
        "staleness_window_s": rec.get("staleness_window_s"),
        "replica_window_s_median": window,
        "replica_window_s_max": max(windows, default=None),
        "roll_over_window_ratio": roll_s / window if roll_s and window else None,
        "phases_s_median": {k: round(statistics.median(v), 4) for k, v in phases.items()},
        "admitting_min": min(during, default=None),
        "admitting_mean": statistics.fmean(during) if during else None,
        "samples": len(during),
        "error": rec.get("error", ""),
    }


async def _memory_per_binding(
    http: aiohttp.ClientSession, r: aioredis.Redis, url: str, n: int
) -> dict[str, Any]:
    """Open ``n`` sessions with no load running: Redis memory added per active binding."""
    before = int((await r.info("memory"))["used_memory_dataset"])
    sem = asyncio.Semaphore(16)

    async def open_one() -> str | None:
        async with sem, http.post(url + "/v1/rollouts", json={}) as resp:
            return str((await resp.json())["rollout_id"]) if resp.status == 201 else None

    ids = [x for x in await asyncio.gather(*(open_one() for _ in range(n))) if x]
    after = int((await r.info("memory"))["used_memory_dataset"])

    async def close(rid: str) -> None:
        async with sem, http.post(f"{url}/v1/rollouts/{rid}/close") as resp:
            await resp.read()

    await asyncio.gather(*(close(x) for x in ids))
    return {
        "sessions_opened": len(ids),
        "used_memory_dataset_before": before,
        "used_memory_dataset_after": after,
        "bytes_per_active_binding": round((after - before) / len(ids)) if ids else None,
    }


def _per(x: float, n: int, scale: float = 1.0) -> float | None:
    return round(scale * x / n, 3) if n else None


async def _run(p: Params, stack: Stack, http: aiohttp.ClientSession) -> dict[str, Any]:
    store = RedisStore.connect(StoreSettings(url=stack.redis.url, namespace=NAMESPACE))
    r = aioredis.Redis.from_url(stack.redis.url, decode_responses=True)
    load = Load()
    markers = {0: marker_token(0)}
    workers: list[asyncio.Task[None]] = []
    try:
        await asyncio.sleep(p.settle_s)  # grants taken, the views read: the steady background
        w = await _Window(r, stack, load).begin()
        await asyncio.sleep(p.idle_s)
        idle = await w.end()
        workers = [
            asyncio.create_task(worker(http, stack.router_urls, p, load, i))
            for i in range(p.concurrency)
        ]
        await asyncio.sleep(2.0)  # warm-up: connections, views, scripts loaded
        w = await _Window(r, stack, load).begin()
        await asyncio.sleep(p.steady_s)
        steady = await w.end()
        n0 = len(load.rollouts)
        sent, scripted = await _monitor(stack.redis.url, p.monitor_s)
        monitored = len(load.rollouts) - n0

        load.session_share = p.session_share
        samples: list[tuple[float, float]] = []
        stop_sampler = asyncio.Event()
        sampler = asyncio.create_task(_sampler(store, p, samples, stop_sampler))
        t_roll, n_roll = time.monotonic(), len(load.rollouts)
        w_roll = await _Window(r, stack, load).begin()
        updates = []
        for n in range(1, p.updates + 1):
            rec = await push(http, stack, n, p)
            markers[int(rec["generation"])] = marker_token(n % MARKERS)
            updates.append(_update_row(rec, samples, p))
            await asyncio.sleep(0.5)
        roll_wall, roll_rollouts = time.monotonic() - t_roll, len(load.rollouts) - n_roll
        roll = await w_roll.end()
        stop_sampler.set()
        await sampler
        load.stop.set()
        await asyncio.gather(*workers)
        sessions = min(p.memory_sessions, p.replicas * p.capacity // 2)
        memory = await _memory_per_binding(http, r, stack.router_urls[0], sessions)
        await asyncio.sleep(1.0)
        leased = await store.leased_rollouts()
        recs = await store.replicas()
        latest = await store.latest()
    finally:
        load.stop.set()
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await store.close()
        await r.aclose()
    return _report(p, idle, steady, roll, sent, scripted, monitored, updates, samples, load,
                   markers, memory, leased, recs, latest[0].number if latest else None,
                   roll_wall, roll_rollouts)  # fmt: skip


def _report(
    p: Params,
    idle: dict[str, Any],
    steady: dict[str, Any],
    roll: dict[str, Any],
    sent: Counter[str],
    scripted: Counter[str],
    monitored: int,
    updates: list[dict[str, Any]],
    samples: list[tuple[float, float]],
    load: Load,
    markers: dict[int, int],
    memory: dict[str, Any],
    leased: int,
    recs: list[Any],
    latest: int | None,
    roll_wall: float,
    roll_rollouts: int,
) -> dict[str, Any]:
    n = steady["rollouts"]
    wall = steady["wall_s"]
    bg_cpu = idle["redis_cpu_s"] / idle["wall_s"] * wall
    bg_cmds = idle["redis_commands"] / idle["wall_s"] * wall
    router_ms = [x.router_ms for x in steady["rollouts_list"] if x.router_ms is not None]
    path = sum(v for k, v in sent.items() if k.startswith("eval"))
    view = sum(sent[k] for k in ("smembers", "hgetall", "scard"))
    cross = [
        x.id for x in load.rollouts if x.tokens != {markers.get(x.generation, -1)} or not x.tokens
    ]
    ideal = (p.replicas - p.k) / p.replicas
    ok_updates = [u for u in updates if u["state"] == "succeeded"]
    cap = [u["admitting_min"] for u in ok_updates if u["admitting_min"] is not None]
    ratios = [u["roll_over_window_ratio"] for u in ok_updates if u["roll_over_window_ratio"]]
    last = updates[-1]["generation"] if updates else latest
    failures = {k: v for k, v in load.statuses.items() if not k.split()[-1].startswith("2")}
    return {
        "replicas": p.replicas,
        "routers": p.routers,
        "k": p.k,
        "updates": len(updates),
        "updates_succeeded": len(ok_updates),
        "rollouts": len(load.rollouts),
        "rollouts_single": sum(1 for x in load.rollouts if x.kind == "single"),
        "rollouts_session": sum(1 for x in load.rollouts if x.kind == "session"),
        "rollouts_per_s": round(n / wall, 1),
        "rollouts_per_s_during_roll": round(roll_rollouts / roll_wall, 1),
        "router_cpu_ms_per_1000_rollouts": _per(steady["cpu_s"]["routers"], n, 1e6),
        "redis_cpu_us_per_rollout": _per(steady["redis_cpu_s"], n, 1e6),
        "redis_cpu_us_per_rollout_marginal": _per(steady["redis_cpu_s"] - bg_cpu, n, 1e6),
        "redis_commands_per_rollout": _per(path, monitored),
        "redis_commands_per_rollout_all": _per(sum(sent.values()), monitored),
        "redis_view_refresh_commands_per_rollout": _per(view, monitored),
        "redis_sent_per_rollout_by_command": {
            k: _per(v, monitored) for k, v in sent.most_common(12)
        },
        "redis_script_commands_per_rollout": _per(sum(scripted.values()), monitored),
        "redis_executed_per_rollout_marginal": _per(steady["redis_commands"] - bg_cmds, n),
        # INFO commandstats over the steady window: calls and microseconds inside each command
        # (script calls include the commands they run; networking and parsing are not in usec)
        "redis_commandstats_per_rollout": {
            k: {"calls": _per(c, n), "usec": _per(u, n)}
            for k, (c, u) in sorted(steady["redis_calls"].items(), key=lambda x: -x[1][1])[:10]
        },
        "redis_idle_commands_per_s": round(idle["redis_commands"] / idle["wall_s"], 1),
        "added_latency_ms": {
            "p50": round(pct(router_ms, 50), 3) if router_ms else None,
            "p99": round(pct(router_ms, 99), 3) if router_ms else None,
        },
        "roll_s": [u["roll_s"] for u in updates],
        "replica_window_s_median": _med([u["replica_window_s_median"] for u in ok_updates]),
        "roll_over_window_ratio_max": round(max(ratios), 2) if ratios else None,
        "admitting_min": min(cap, default=None),
        "admitting_ideal": round(ideal, 4),
        "capacity_ratio_vs_ideal": round(min(cap) / ideal, 3) if cap and ideal else None,
        "cross_generation": len(cross),
        "cross_generation_ids": cross[:5],
        "leaked_bindings": leased + sum(x.active for x in recs),
        "all_on_last_generation": bool(recs)
        and all(x.state is S.READY and x.generation == last for x in recs),
        "last_generation": last,
        "redis_bytes_per_active_binding": memory["bytes_per_active_binding"],
        "memory": memory,
        "failures": failures,
        "cores_idle": idle["cores"],
        "cores_steady": steady["cores"],
        "cores_roll": roll["cores"],
        # the updater's CPU: per replica updated (rolls; its health loop included) and per
        # second with no update running (steady window; its health loop polls every replica
        # every health_interval_s)
        "updater_cpu_ms_per_replica_update": _per(
            roll["cpu_s"]["updater"], sum(u["replicas_updated"] for u in updates), 1e3
        ),
        "updater_cpu_ms_per_s_no_update": _per(steady["cpu_s"]["updater"], 1, 1e3 / wall),
        "per_update": updates,
        "params": {k: v for k, v in p.__dict__.items()},
    }


def _med(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return round(statistics.median(v), 4) if v else None


async def scenario(p: Params, work: Path) -> dict[str, Any]:
    """One configuration, start to stop (see the module docstring); returns its row."""
    await asyncio.gather(*(asyncio.to_thread(marker_model, g) for g in range(MARKERS)))
    timeout = aiohttp.ClientTimeout(total=120)
    async with AsyncExitStack() as es:
        http = await es.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        )
        stack = await start_stack(p, work, http)
        es.callback(stack.stop)
        t0 = time.monotonic()
        row = await _run(p, stack, http)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        return row
