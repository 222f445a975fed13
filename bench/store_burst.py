"""Store burst: a thousand rollouts in flight through one router, each outliving its lease.

    python -m bench.store_burst [--rollouts 1000] [--rounds 3] [--hold-s 12] [--lease-s 5]

Setup (all on this machine): a local ``redis-server``; the router as its own process
(``python -m router``, its default settings but for ``request_lease_s`` = ``--lease-s``, a
0.5 s reaper interval, so a lapsed lease is reaped at once, and enough upstream connections);
and, as the upstream, an aiohttp stand-in for vLLM's completions API in its own process that
holds every request ``--hold-s`` before it answers (no real server holds a thousand requests at
once on a 2-core box). Four replicas point at it, 256 rollouts of capacity each.

Each round sends ``--rollouts`` one-request rollouts at once and waits for every answer. A
request held ``--hold-s`` = 12 s needs its 5 s lease renewed at least twice, for a thousand
bindings at a time. The first measurement (with redis-py's default non-blocking pool of 100) saw
200 of 400 concurrent requests answered ``503 store_unavailable`` while Redis was healthy and,
with a 3 s lease, the router's own reaper abort 200 of its live rollouts.

Reported per round and in total: ``in_flight`` (the stand-in's peak of requests held at once),
``spurious_503`` (any 503: Redis is healthy and capacity suffices, so every one is spurious;
by code), ``self_reaped`` (bindings the router's own reaper aborted, "lease expired", while
their request was alive — every request is alive until the stand-in answers), other failures,
and latency (client total, and the router's part: total minus the hold). Goal: 0 spurious
503s and 0 self-reaped bindings. Writes ``bench/results/store_burst.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench._meta import write
from pool.launcher import free_port
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import BindingState
from testkit.harness import publish_ready
from testkit.procs import terminate
from testkit.redis_server import RedisServer
from testkit.stats import pct

NAMESPACE = "burst"
MODEL = "/standin/model"
REPLICAS = 4
STANDIN = [sys.executable, "-m", "bench.store_burst", "--upstream"]
CAPACITY = 256


def upstream_server(port: int, hold_s: float) -> None:
    """The stand-in (``--upstream PORT``): vLLM's ``/v1/models``, ``/version`` and
    ``/v1/completions`` (answered after ``hold_s``), and ``/stats`` (peak requests held)."""
    from aiohttp import web

    held = {"now": 0, "peak": 0, "served": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        held["now"] += 1
        held["peak"] = max(held["peak"], held["now"])
        try:
            await asyncio.sleep(hold_s)
        finally:
            held["now"] -= 1
        held["served"] += 1
        return web.json_response(
            {
                "id": "cmpl-standin",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )

    async def stats(request: web.Request) -> web.Response:
        out = dict(held)
        if request.query.get("reset"):
            held["peak"] = held["now"]
        return web.json_response(out)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


async def wait_up(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


async def one_round(
    router_url: str, upstream_url: str, store: RedisStore, n: int, hold_s: float
) -> dict[str, Any]:
    results: list[tuple[int, str, float, float]] = []  # status, code or rollout id, s, admit s
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=hold_s * 10)
    body = {"model": "rolloutpool", "prompt": "burst", "max_tokens": 1}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        async with http.get(f"{upstream_url}/stats?reset=1"):
            pass
        start = asyncio.Event()

        async def one() -> None:
            await start.wait()
            t0 = time.perf_counter()
            try:
                async with http.post(f"{router_url}/v1/completions", json=body) as r:
                    raw = await r.read()
                    rid = r.headers.get("X-Rollout-Id", "")
                    admit = 0.0
                    for part in r.headers.get("Server-Timing", "").split(","):
                        name, _, dur = part.strip().partition(";dur=")
                        if name == "admit" and dur:
                            admit = float(dur) / 1000
                    code = rid
                    if r.status != 200:
                        code = json.loads(raw).get("error", {}).get("code", "?") + f" {rid}"
                    results.append((r.status, code, time.perf_counter() - t0, admit))
            except (aiohttp.ClientError, TimeoutError) as e:
                results.append((0, type(e).__name__, time.perf_counter() - t0, 0.0))

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0.5)  # every task is waiting on the start signal
        t_start = time.monotonic()
        start.set()
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t_start
        async with http.get(f"{upstream_url}/stats") as r:
            stats = await r.json()

    ok = [r for r in results if r[0] == 200]
    reaped: list[str] = []
    ended: Counter[str] = Counter()
    for _, code, _, _ in results:
        rid = code.split()[-1] if code else ""
        if not rid.startswith("ro-"):
            continue
        b = await store.binding(rid)
        ended[f"{b.state}: {b.reason}" if b.reason else str(b.state)] += 1
        if b.state is BindingState.ABORTED and b.reason == "lease expired":
            reaped.append(rid)
    totals = [r[2] for r in ok]
    router_part = [max(0.0, t - hold_s) for t in totals]
    admits = [r[3] for r in ok]
    failures = Counter(f"{s} {c.split()[0]}" for s, c, _, _ in results if s != 200)
    return {
        "rollouts": n,
        "in_flight": stats["peak"],
        "answered_200": len(ok),
        "spurious_503": sum(1 for r in results if r[0] == 503),
        "self_reaped": len(reaped),
        "failures_by_status_and_code": dict(failures),
        "bindings_ended": dict(ended),
        "wall_s": round(wall, 3),
        "latency_s": {
            "p50": round(pct(totals, 50), 3),
            "p99": round(pct(totals, 99), 3),
            "max": round(max(totals, default=0.0), 3),
        },
        "router_added_s": {
            "p50": round(pct(router_part, 50), 3),
            "p99": round(pct(router_part, 99), 3),
            "max": round(max(router_part, default=0.0), 3),
            "mean": round(statistics.fmean(router_part), 3) if router_part else None,
        },
        "admit_s": {"p50": round(pct(admits, 50), 4), "p99": round(pct(admits, 99), 4)},
    }


async def measure(
    args: argparse.Namespace, redis_url: str, router_url: str, upstream_url: str
) -> tuple[list[dict[str, Any]], int]:
    """Publish the replicas, run the rounds; returns them and the leases left at the end."""
    store = RedisStore.connect(StoreSettings(url=redis_url, namespace=NAMESPACE))
    try:
        await wait_up(f"{upstream_url}/version")
        await wait_up(f"{router_url}/healthz")
        replicas = [(f"r{i}", upstream_url) for i in range(REPLICAS)]
        await publish_ready(store, replicas, capacity=CAPACITY)
        rounds = []
        for i in range(args.rounds):
            r = await one_round(router_url, upstream_url, store, args.rollouts, args.hold_s)
            print(f"round {i + 1}: {json.dumps(r)}", flush=True)
            rounds.append(r)
        await asyncio.sleep(1.0)  # the last releases land
        return rounds, await store.leased_rollouts()
    finally:
        await store.close()


def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="store-burst-") as d, RedisServer(Path(d)) as redis:
        work = Path(d)
        up_port, router_port = free_port(), free_port()
        upstream = subprocess.Popen(
            [*STANDIN, str(up_port), "--hold-s", str(args.hold_s)],
            start_new_session=True,
        )
        env = {
            **os.environ,
            "ROLLOUTPOOL_REDIS_URL": redis.url,
            "ROLLOUTPOOL_REDIS_NAMESPACE": NAMESPACE,
            "ROLLOUTPOOL_ROUTER_PORT": str(router_port),
            "ROLLOUTPOOL_ROUTER_REQUEST_LEASE_S": str(args.lease_s),
            "ROLLOUTPOOL_ROUTER_REAPER_INTERVAL_S": "0.5",
            "ROLLOUTPOOL_ROUTER_UPSTREAM_CONNECTIONS": str(args.rollouts * 2),
            "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
        }
        with (work / "router.log").open("wb") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "router"],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            try:
                rounds, leaked = asyncio.run(
                    measure(
                        args,
                        redis.url,
                        f"http://127.0.0.1:{router_port}",
                        f"http://127.0.0.1:{up_port}",
                    )
                )
            finally:
                terminate(router)
                terminate(upstream)
        router_log = (work / "router.log").read_text(errors="replace")
    return {
        "rollouts_per_round": args.rollouts,
        "rounds": args.rounds,
        "hold_s": args.hold_s,
        "request_lease_s": args.lease_s,
        "reaper_interval_s": 0.5,
        "replicas": REPLICAS,
        "capacity_per_replica": CAPACITY,
        "in_flight": min(r["in_flight"] for r in rounds),
        "spurious_503": sum(r["spurious_503"] for r in rounds),
        "self_reaped": sum(r["self_reaped"] for r in rounds),
        "answered_200": sum(r["answered_200"] for r in rounds),
        "leased_after": leaked,
        "latency_s_p99_worst_round": max(r["latency_s"]["p99"] for r in rounds),
        "router_added_s_p99_worst_round": max(r["router_added_s"]["p99"] for r in rounds),
        "goal": "0 spurious 503s and 0 self-reaped bindings with 1,000 rollouts in flight",
        "goal_met": all(r["spurious_503"] == 0 and r["self_reaped"] == 0 for r in rounds),
        "per_round": rounds,
        "router_log_warnings": [ln for ln in router_log.splitlines() if "WARNING" in ln][:20],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hold-s", type=float, default=12.0)
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstream:
        upstream_server(args.upstream, args.hold_s)
    else:
        print(write("store_burst", main(args)))
