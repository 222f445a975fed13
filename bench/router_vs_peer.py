"""RolloutPool's router side by side with two peer routers: ``vllm-router`` 0.1.17 and SMG
(the SGLang model gateway, PyPI ``smg``), both round robin.

    python -m bench.router_vs_peer [--requests 6000] [--concurrency 1 16 64] [--router-workers 1]
                                   [--skip-e2e] [--e2e-rounds 2] [--skip-profile]

Setup, all on this machine, all separate processes: an instant stand-in vLLM
(:mod:`testkit.standin.process`: no per-token delay, one SSE event per token, uvloop), a local
``redis-server`` (:mod:`testkit.redis_server`, AOF everysec), RolloutPool's router as deployed
(``python -m router``, grants on; the stand-in registered READY on g0 through
:func:`testkit.harness.publish_ready`), and the peers in front of the same stand-in
(:mod:`bench._peers`: installed from PyPI into a venv under ``/tmp`` if missing, with py-spy for
the profile; a peer that cannot be installed or started is left out and the JSON says why,
``peers.left_out``). This process is the client: aiohttp on uvloop, one keep-alive connection
pool, bodies encoded once.

Measured, in this order:

1. **Interleaved** (the comparison): for each concurrency ``c``, ``c`` client tasks share one
   counter and request ``k`` goes to direct / RolloutPool / vllm-router / SMG by ``k % paths``,
   so all paths run at the same time under the same load; non-streamed ``/v1/completions``
   (``max_tokens`` 1) and streamed ones (SSE, 32 one-token chunks). Per path: p50/p99,
   requests/s, mean requests in flight (Little's law); per router: added p50/p99 (minus direct,
   same run) and CPU-seconds per 1,000 requests (its process tree, ``/proc/<pid>/stat``).
2. **Each path alone** at concurrency 64 (closed loop): the most requests/s each path gives on
   this box, and who uses the cores meanwhile (client, stand-in, routers, Redis).
3. **Redis cost** (:mod:`bench._redis_cost`): commands per rollout under ``MONITOR`` and the
   round trips requests waited for, with grants and, side by side, a router without them.
4. **Profile** (py-spy, raw stacks, on-CPU samples only) of RolloutPool's router alone at
   concurrency 16: where its CPU goes per request (:mod:`bench._router_profile`).
5. ``bench.admission``'s one-connection run (admit+release pairs/s: the session path).
6. **End to end** with vLLM's own client (:mod:`bench._e2e_vllm`): 2 real vLLM CPU replicas
   (vllm-router only).

``--router-workers N ...`` runs phase 2 once per value with ``python -m router --workers N``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import _e2e_vllm, _redis_cost, _router_profile
from bench._meta import RESULTS, write
from bench._peers import STARTERS, TOOLS_VENV, Server, Tools, ensure_tools, spawn, start_peer
from bench._peers import wait_ready as wait_ready
from bench._proc import CpuMeter, all_processes, descendants, others
from bench.admission import run as admission_run
from pool.launcher import free_port
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.harness import publish_ready
from testkit.redis_server import RedisServer
from testkit.standin.process import STANDIN_MODEL, StandinProcess, new_event_loop
from testkit.stats import pct

PROMPT = "the quick brown fox"
STREAM_TOKENS = 32


# ------------------------------------------------------------------------------ processes


async def start_router(
    work: Path, redis_url: str, namespace: str, workers: int = 1, *, grants: bool = True
) -> Server:
    """``python -m router`` on a free port against ``namespace``; ready when /healthz is 200
    (``grants`` False: one ADMIT and one RELEASE per request, the path before grants)."""
    port = free_port()
    env = {
        "ROLLOUTPOOL_ROUTER_GRANTS": "true" if grants else "false",
        **os.environ,
        "ROLLOUTPOOL_ROUTER_HOST": "127.0.0.1",
        "ROLLOUTPOOL_ROUTER_PORT": str(port),
        "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
        "ROLLOUTPOOL_ROUTER_WORKERS": str(workers),
        "ROLLOUTPOOL_REDIS_URL": redis_url,
        "ROLLOUTPOOL_REDIS_NAMESPACE": namespace,
    }
    argv = [sys.executable, "-m", "router"] + (["--workers", str(workers)] if workers != 1 else [])
    proc = await spawn(work, f"router-{namespace}-w{workers}-g{int(grants)}", argv, env)
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url + "/healthz", proc)
    await all_workers_listen(url, workers)
    return Server("rolloutpool", proc, url)


async def all_workers_listen(url: str, workers: int, timeout_s: float = 120) -> None:
    """Until each of ``workers`` processes answered ``/healthz`` (new connections are spread
    only over the workers already listening; the client's keep-alive pool is made after)."""
    pids: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(pids) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(pids)} of {workers} router workers answered")
        async with aiohttp.ClientSession() as s, s.get(url + "/healthz") as r:
            if r.status == 200:
                pids.add((await r.json())["worker"]["pid"])
            else:
                await asyncio.sleep(0.1)


# ------------------------------------------------------------------------------ load


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


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    body: bytes


def targets(urls: dict[str, str], stream: bool) -> dict[str, Target]:
    """One pre-encoded request per path (the router is asked for its own model name)."""
    import json

    out = {}
    for name, url in urls.items():
        body: dict[str, Any] = {
            "model": "rolloutpool" if name == "rolloutpool" else STANDIN_MODEL,
            "prompt": PROMPT,
            "max_tokens": STREAM_TOKENS if stream else 1,
            "temperature": 0,
        }
        if stream:
            body["stream"] = True
        out[name] = Target(name, url + "/v1/completions", json.dumps(body).encode())
    return out


@dataclass
class Record:
    latency: dict[str, list[float]] = field(default_factory=dict)
    first_byte: dict[str, list[float]] = field(default_factory=dict)
    timings: list[dict[str, float]] = field(default_factory=list)


HEADERS = {"Content-Type": "application/json"}


async def one(s: aiohttp.ClientSession, t: Target, stream: bool, rec: Record | None) -> None:
    t0 = time.perf_counter()
    first = None
    async with s.post(t.url, data=t.body, headers=HEADERS) as r:
        if stream:
            raw = bytearray()
            async for piece in r.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                raw += piece
        else:
            raw = bytearray(await r.read())
        if r.status != 200:
            raise RuntimeError(f"{t.name}: HTTP {r.status}: {bytes(raw[:300])!r}")
        if stream and (raw.count(b"data: ") != STREAM_TOKENS + 1 or b"data: [DONE]" not in raw):
            raise RuntimeError(f"{t.name}: bad stream: {bytes(raw[-300:])!r}")
        timing = r.headers.get("Server-Timing") if t.name == "rolloutpool" else None
    if rec is not None:
        rec.latency.setdefault(t.name, []).append((time.perf_counter() - t0) * 1000)
        if first is not None:
            rec.first_byte.setdefault(t.name, []).append((first - t0) * 1000)
        if timing:
            rec.timings.append(server_timing(timing))


async def drive(
    s: aiohttp.ClientSession,
    pick: Callable[[int], Target],
    concurrency: int,
    total: int,
    stream: bool,
    rec: Record | None,
) -> None:
    """``concurrency`` tasks send ``total`` requests back to back; request k goes to pick(k)."""
    counter = itertools.count()

    async def worker() -> None:
        while (k := next(counter)) < total:
            await one(s, pick(k), stream, rec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def path_stats(rec: Record, name: str, wall_s: float) -> dict[str, Any]:
    lat = rec.latency[name]
    out: dict[str, Any] = {"requests": len(lat), **summary(lat)}
    out["requests_per_s"] = round(len(lat) / wall_s, 1)
    out["mean_in_flight"] = round(len(lat) / wall_s * statistics.fmean(lat) / 1000, 2)
    if name in rec.first_byte:
        out["first_chunk"] = summary(rec.first_byte[name])
    return out


def cpu_per_1000(window: dict[str, Any], name: str, requests: int) -> float:
    return round(float(window["cpu_s"][name]) / requests * 1000, 3)


def wait_ms_per_request(window: dict[str, Any], name: str, requests: int) -> float:
    return round(float(window["runqueue_wait_s"][name]) / requests * 1000, 3)


async def interleaved(
    s: aiohttp.ClientSession,
    ts: dict[str, Target],
    meter: CpuMeter,
    concurrency: int,
    total: int,
    stream: bool,
) -> dict[str, Any]:
    order = list(ts.values())

    def pick(k: int) -> Target:
        return order[k % len(order)]

    await drive(s, pick, concurrency, max(90, 3 * concurrency), stream, None)  # warm-up
    rec = Record()
    a = meter.snap()
    await drive(s, pick, concurrency, total, stream, rec)
    w = CpuMeter.window(a, meter.snap())
    paths = {p: path_stats(rec, p, w["wall_s"]) for p in ts}
    d = paths["direct"]
    out: dict[str, Any] = {"concurrency": concurrency, "stream": stream, "paths": paths}
    for r in (p for p in ts if p != "direct"):
        x = paths[r]
        out[r] = {
            "added_p50_ms": round(x["p50_ms"] - d["p50_ms"], 3),
            "added_p99_ms": round(x["p99_ms"] - d["p99_ms"], 3),
            "cpu_s_per_1000_requests": cpu_per_1000(w, r, x["requests"]),
            "runqueue_wait_ms_per_request": wait_ms_per_request(w, r, x["requests"]),
        }
        if stream:
            fc, dfc = x["first_chunk"], d["first_chunk"]
            out[r]["added_first_chunk_p50_ms"] = round(fc["p50_ms"] - dfc["p50_ms"], 3)
    if rec.timings:
        out["rolloutpool"]["server_timing_ms"] = {
            k: summary([t[k] for t in rec.timings if k in t])
            for k in ("admit", "upstream", "router")
        }
    out["cpu"] = w
    return out


async def closed_loop(
    send: Callable[[], Awaitable[None]], concurrency: int, duration_s: float
) -> tuple[int, float]:
    """``concurrency`` tasks call ``send`` back to back for ``duration_s``; (calls, wall s)."""
    stop = time.monotonic() + duration_s
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await send()
            done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.monotonic() - t0


async def alone(
    s: aiohttp.ClientSession, t: Target, meter: CpuMeter, concurrency: int, duration_s: float
) -> dict[str, Any]:
    await drive(s, lambda k: t, concurrency, 4 * concurrency, False, None)  # warm-up
    rec = Record()
    a = meter.snap()
    await closed_loop(lambda: one(s, t, False, rec), concurrency, duration_s)
    w = CpuMeter.window(a, meter.snap())
    out = {"concurrency": concurrency, **path_stats(rec, t.name, w["wall_s"]), "cpu": w}
    if t.name != "direct":
        n = len(rec.latency[t.name])
        out["cpu_s_per_1000_requests"] = cpu_per_1000(w, t.name, n)
        out["runqueue_wait_ms_per_request"] = wait_ms_per_request(w, t.name, n)
    return out


# ------------------------------------------------------------------------------ main


def client_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def standin_phases(args: argparse.Namespace, work: Path, tools: Tools) -> dict[str, Any]:
    out: dict[str, Any] = {"peers_left_out": dict(tools.missing)}
    with RedisServer(work / "redis") as redis, StandinProcess() as standin:
        store = RedisStore.connect(StoreSettings(url=redis.url, namespace="peer"))
        await publish_ready(store, [("standin", standin.url)], capacity=1_000_000)
        await store.close()
        assert redis.proc is not None
        servers: list[Server] = []
        try:
            rp = await start_router(work, redis.url, "peer")
            servers.append(rp)
            pids = {"rolloutpool": rp.pid, "standin": standin.pid, "redis": redis.proc.pid}
            urls = {"direct": standin.url, "rolloutpool": rp.url}
            for name in tools.versions:
                try:
                    peer = await STARTERS[name](
                        work, tools.python, [standin.url], f"{name}-standin"
                    )
                except RuntimeError as e:
                    out["peers_left_out"][name] = f"did not start: {e} (see {work})"
                    continue
                servers.append(peer)
                pids[name], urls[name] = peer.pid, peer.url
            meter = CpuMeter({**pids, "client": os.getpid()}, alone={"client"})
            plain, streamed = targets(urls, stream=False), targets(urls, stream=True)
            async with client_session() as s:
                for c in args.concurrency:
                    out[f"c{c}"] = await interleaved(s, plain, meter, c, args.requests, False)
                    print(f"c{c}", summary_line(out[f"c{c}"]), flush=True)
                for c in args.concurrency:
                    res = await interleaved(s, streamed, meter, c, args.stream_requests, True)
                    out[f"stream_c{c}"] = res
                    print(f"stream c{c}", summary_line(res), flush=True)
                solo = out["alone"] = {}
                for p in plain:
                    solo[p] = await alone(s, plain[p], meter, args.alone_concurrency, args.alone)
                    print(f"alone {p}: {solo[p]['requests_per_s']} req/s", flush=True)
                out["redis_cost"] = await redis_cost(args, work, redis.url, s, plain)
                workers = out["by_router_workers"] = {}
                for n in args.router_workers:
                    if n == 1:
                        res = solo["rolloutpool"]
                    else:
                        rpn = await start_router(work, redis.url, "peer", workers=n)
                        servers.append(rpn)
                        meter.pids["rolloutpool"] = rpn.pid
                        body = plain["rolloutpool"].body
                        t = Target("rolloutpool", rpn.url + "/v1/completions", body)
                        res = await alone(s, t, meter, args.alone_concurrency, args.alone)
                        meter.pids["rolloutpool"] = rp.pid
                        await rpn.stop()
                    workers[str(n)] = {
                        "requests_per_s": res["requests_per_s"],
                        "requests_per_s_per_worker": round(res["requests_per_s"] / n, 1),
                        "p50_ms": res["p50_ms"],
                        "p99_ms": res["p99_ms"],
                        "cpu_s_per_1000_requests": res["cpu_s_per_1000_requests"],
                    }
                if not args.skip_profile:
                    target = plain["rolloutpool"]
                    bare = await alone(s, target, meter, 16, 5.0)  # the same load, no profiler
                    prof = await _router_profile.profile(
                        lambda: closed_loop(lambda: one(s, target, False, None), 16, 10.0),
                        rp.pid,
                        tools.pyspy,
                        meter,
                        work,
                        concurrency=16,
                        duration_s=10.0,
                    )
                    prof["without_profiler"] = {
                        "requests_per_s": bare["requests_per_s"],
                        "router_cpu_ms_per_request": bare["cpu_s_per_1000_requests"],
                        "note": "the same load for 5 s just before, not sampled: py-spy pauses "
                        "the router for each sample, which costs throughput and some CPU; the "
                        "shares are what matter",
                    }
                    out["profile"] = prof
        finally:
            for srv in servers:
                await srv.stop()
    return out


async def redis_cost(
    args: argparse.Namespace,
    work: Path,
    redis_url: str,
    s: aiohttp.ClientSession,
    plain: dict[str, Target],
) -> dict[str, Any]:
    """:func:`bench._redis_cost.measure` on the router as run above (grants), then on one
    started with grants off (ADMIT + RELEASE per request) for the side-by-side figure."""
    out: dict[str, Any] = {}
    for grants in (True, False):
        if grants:
            url = plain["rolloutpool"].url.removesuffix("/v1/completions")
            srv = None
        else:
            srv = await start_router(work, redis_url, "peer", grants=False)
            url = srv.url
        t = Target("rolloutpool", url + "/v1/completions", plain["rolloutpool"].body)

        async def send(t: Target = t) -> None:
            await one(s, t, False, None)

        try:
            res = await _redis_cost.measure(redis_url, url, send, args.cost_requests, 16)
        finally:
            if srv is not None:
                await srv.stop()
        out["grants" if grants else "without_grants"] = res
        print(f"redis cost (grants={grants}): {res}", flush=True)
    return out


def summary_line(r: dict[str, Any]) -> str:
    p = r["paths"]
    return " | ".join(
        f"{n} p50 {p[n]['p50_ms']} p99 {p[n]['p99_ms']} ms {p[n]['requests_per_s']}/s" for n in p
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    procs_before = all_processes()
    tools = await asyncio.to_thread(ensure_tools, args.tools_venv)
    print(f"peers: {tools.versions}; left out: {tools.missing}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    t0 = time.monotonic()
    standin = await standin_phases(args, work, tools)
    standin_s = time.monotonic() - t0
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d)) as server:
        # asyncio's own loop, as bench.admission runs it (this process runs on uvloop)
        coro = admission_run(server.url, args.admission_pairs, 1)
        admission = await asyncio.to_thread(asyncio.run, coro)
    print(f"admission, one connection: {admission:,.0f} pairs/s", flush=True)
    e2e = None
    if args.skip_e2e:
        e2e = carried_e2e(args.out)
    else:
        e2e = await _e2e_vllm.run(
            work / "e2e", tools.python, start_router, start_peer, rounds=args.e2e_rounds
        )
    ours = set(descendants(os.getpid()))
    return assemble(
        args,
        tools,
        standin,
        admission,
        e2e,
        {
            "load_average_start": [round(x, 2) for x in load_start],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "standin_phases_s": round(standin_s, 1),
            "other_processes": others(procs_before, all_processes(), ours),
        },
    )


def carried_e2e(name: str) -> dict[str, Any] | None:
    """The end-to-end phase of the previous result file, marked as carried over (its date and
    command), for a run with ``--skip-e2e``; None if there is none."""
    import json

    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    e2e: dict[str, Any] | None = old.get("e2e_vllm_bench_serve")
    if not e2e:
        return None
    if "carried_over" not in e2e:
        e2e = {
            "carried_over": {
                "date": old.get("date"),
                "command": old.get("command"),
                "note": "not rerun with this file's other phases (--skip-e2e): measured in "
                "the run of that date; it is bound by the vLLM replicas (router and Redis used "
                "a few % of the cores), not by the router's own cost",
            },
            **e2e,
        }
    return e2e


def remaining_cost(standin: dict[str, Any]) -> dict[str, Any] | None:
    """What RolloutPool's router spends per request, by mechanism (the profile's top six, in
    microseconds), next to the peers' CPU per request alone: the cost the goals still miss."""
    prof = standin.get("profile")
    if not prof:
        return None
    return {
        "router_cpu_ms_per_request": prof["router_cpu_ms_per_request"],
        "by_mechanism_us": {m["mechanism"]: m["us_per_request"] for m in prof["by_mechanism"][:6]},
        "peers_cpu_ms_per_request_alone": {
            p: v.get("cpu_s_per_1000_requests")
            for p, v in standin["alone"].items()
            if p not in ("direct", "rolloutpool")
        },
    }


def assemble(
    args: argparse.Namespace,
    tools: Tools,
    standin: dict[str, Any],
    admission: float,
    e2e: dict[str, Any] | None,
    machine: dict[str, Any],
) -> dict[str, Any]:
    def added(c: int, router: str) -> float | None:
        run = standin.get(f"c{c}")
        return None if run is None or router not in run else float(run[router]["added_p50_ms"])

    peers = {name: None for name in STARTERS}  # a peer left out stays None (see peers_left_out)
    workers = standin["by_router_workers"]
    per_worker = workers["1"]["requests_per_s_per_worker"] if "1" in workers else None
    cost = standin["redis_cost"]["grants"]
    head = {
        "added_p50_ms_c1": added(1, "rolloutpool"),
        "peer_added_p50_ms_c1": {p: added(1, p) for p in peers},
        "added_p50_ms_c16": added(16, "rolloutpool"),
        "peer_added_p50_ms_c16": {p: added(16, p) for p in peers},
        "requests_per_s_per_worker": per_worker,
        "router_cpu_ms_per_request": standin["alone"]["rolloutpool"]["cpu_s_per_1000_requests"],
        "redis_round_trips_on_request_path": cost["redis_round_trips_on_request_path"],
        "redis_commands_sent_per_rollout": cost["commands_sent_per_rollout"],
        "redis_commands_in_scripts_per_rollout": cost["commands_in_scripts_per_rollout"],
        "admission_pairs_per_s_one_connection": round(admission, 1),
    }

    def best(c: int) -> float | None:
        xs = [x for x in head[f"peer_added_p50_ms_c{c}"].values() if x is not None]
        return min(xs) if xs else None

    ours, peer = head["added_p50_ms_c1"], best(1)
    ours16, peer16 = head["added_p50_ms_c16"], best(16)
    head["best_peer_added_p50_ms"] = {"c1": peer, "c16": peer16}
    goals = {
        "added_p50_ms_c1": "<= best peer's added p50 at concurrency 1 + 0.5 ms",
        "added_p50_ms_c16": "<= 2 x best peer's added p50 at concurrency 16",
        "requests_per_s_per_worker": ">= 4000",
        "redis_round_trips_on_request_path": "== 0 (steady state)",
    }
    met = {
        "added_p50_ms_c1": ours is not None and peer is not None and ours <= peer + 0.5,
        "added_p50_ms_c16": ours16 is not None and peer16 is not None and ours16 <= 2 * peer16,
        "requests_per_s_per_worker": per_worker is not None and per_worker >= 4000,
        "redis_round_trips_on_request_path": cost["redis_round_trips_on_request_path"] == 0,
    }
    short = {
        "added_p50_ms_c1": None if ours is None or peer is None else round(ours - peer - 0.5, 3),
        "added_p50_ms_c16": None
        if ours16 is None or peer16 is None
        else round(ours16 - 2 * peer16, 3),
        "requests_per_s_per_worker": None if per_worker is None else round(4000 - per_worker, 1),
    }
    return {
        **head,
        "goals": goals,
        "goals_met": met,
        "goals_missed_by": {k: v for k, v in short.items() if v is not None and v > 0},
        "remaining_cost": remaining_cost(standin),
        "peers": {"versions": tools.versions, "left_out": standin["peers_left_out"]},
        "redis_cost": standin["redis_cost"],
        "router_workers": {
            "measured": sorted(workers, key=int),
            "by_workers": workers,
            "note": "requests/s of RolloutPool's router alone at concurrency "
            f"{args.alone_concurrency} on the stand-in, per worker count (python -m router "
            "--workers N: N SO_REUSEPORT processes). On this 2-core box the stand-in, Redis and "
            "the client share the cores with the workers, so a second worker adds less than a "
            "core's worth",
        },
        "interleaved": {k: v for k, v in standin.items() if k.startswith("c")},
        "interleaved_stream": {k: v for k, v in standin.items() if k.startswith("stream_c")},
        "alone": standin["alone"],
        "where_the_time_goes": standin.get("profile"),
        "e2e_vllm_bench_serve": e2e,
        "client": {
            "how": "this process: one aiohttp ClientSession (keep-alive pool, no limit) on "
            "uvloop, bodies encoded once; `concurrency` asyncio tasks send back to back. Its CPU "
            "is reported as cpu.cores.client in every window: below 1 core, it is not the "
            "bottleneck of a path (the stand-in and the client share the cores with the routers).",
            "interleaving": "one shared counter: request k goes to direct, rolloutpool, "
            "vllm_router, smg by k % (the number of paths), so every path sees the same load at "
            "the same time; a slower path holds more of the tasks (see mean_in_flight)",
            "requests_per_path": args.requests // (2 + len(tools.versions)),
            "stream_requests_per_path": args.stream_requests // (2 + len(tools.versions)),
            "alone_seconds_per_path": args.alone,
        },
        "box": machine,
        "setup": "2-core box, everything local: instant stand-in vLLM (testkit."
        "standin.process, uvloop), redis-server (AOF everysec), python -m router (1 process), "
        "vllm-router and SMG (both --policy round_robin, in their own venv under /tmp: "
        "`peers`), and this client. "
        "Non-streamed: /v1/completions max_tokens 1; streamed: stream=true, 32 one-token SSE "
        "chunks from the stand-in. Added latency = router percentile minus direct percentile in "
        "the same interleaved run.",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6000, help="interleaved, all paths")
    ap.add_argument("--stream-requests", type=int, default=1500, help="interleaved, all paths")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--alone", type=float, default=5.0, help="seconds per path alone")
    ap.add_argument("--alone-concurrency", type=int, default=64)
    ap.add_argument("--router-workers", type=int, nargs="+", default=[1])
    ap.add_argument("--admission-pairs", type=int, default=20000)
    ap.add_argument("--cost-requests", type=int, default=3000, help="redis cost phase")
    ap.add_argument("--tools-venv", type=Path, default=TOOLS_VENV)
    ap.add_argument(
        "--skip-e2e",
        action="store_true",
        help="no vLLM phase (item 5): the previous result's is carried over, marked so",
    )
    ap.add_argument("--e2e-rounds", type=int, default=2)
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--out", default="router_vs_peer", help="result name under bench/results")
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        result = runner.run(main_async(args))
    write(args.out, result)


if __name__ == "__main__":
    main()
