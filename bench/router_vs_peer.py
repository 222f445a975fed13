"""RolloutPool's router side by side with a peer router (``vllm-router`` 0.1.17, round robin).

    python -m bench.router_vs_peer [--requests 3000] [--concurrency 1 16 64] [--router-workers 1]
                                   [--skip-e2e] [--e2e-rounds 2] [--skip-profile]

Setup, all on this machine, all separate processes: an instant stand-in upstream
(:mod:`testkit.stub_upstream`), a local ``redis-server`` (:mod:`testkit.redis_server`, AOF
everysec), RolloutPool's router as deployed (``python -m router``; the stub registered READY on
g0 through :func:`testkit.harness.publish_ready`), and ``vllm-router --policy round_robin`` in
front of the same stub (installed from PyPI into ``.cache/vllm-router-venv`` if missing, with
py-spy for the profile). This process is the client: aiohttp on uvloop, one keep-alive
connection pool, bodies encoded once.

Measured, in this order:

1. **Interleaved** (the comparison): for each concurrency ``c``, ``c`` client tasks share one
   counter and request ``k`` goes to direct / RolloutPool / vllm-router by ``k % 3``, so the
   three paths run at the same time under the same load; non-streamed ``/v1/completions``
   (``max_tokens`` 1) and streamed ones (SSE, 32 one-token chunks). Per path: p50/p99, requests/s,
   mean requests in flight (Little's law); per router: added p50/p99 (minus direct, same run) and
   CPU-seconds per 1,000 requests (its process tree, ``/proc/<pid>/stat``).
2. **Each path alone** at concurrency 64 (closed loop): the most requests/s each path gives on
   this box, and who uses the cores meanwhile (client, stub, router, Redis).
3. **Profile** (py-spy, raw stacks, on-CPU samples only) of RolloutPool's router alone at
   concurrency 16: where its CPU goes per request (:mod:`bench._router_profile`).
4. ``bench.admission``'s one-connection run (admit+release pairs/s).
5. **End to end** with vLLM's own client (:mod:`bench._e2e_vllm`): 2 real vLLM CPU replicas.

``--router-workers N ...`` runs phase 2 once per value with ``python -m router --workers N``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import _e2e_vllm, _router_profile
from bench._meta import RESULTS, write
from bench._proc import CpuMeter, all_processes, descendants, others
from bench.admission import run as admission_run
from pool.launcher import free_port
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.harness import publish_ready
from testkit.redis_server import RedisServer
from testkit.stub_upstream import STUB_MODEL, StubUpstream, new_event_loop

ROOT = Path(__file__).resolve().parent.parent
TOOLS_VENV = ROOT / ".cache" / "vllm-router-venv"
PEER_VERSION = "0.1.17"
PROMPT = "the quick brown fox"
STREAM_TOKENS = 32
PATHS = ("direct", "rolloutpool", "vllm_router")
ROUTERS = ("rolloutpool", "vllm_router")


# ------------------------------------------------------------------------------ processes


def ensure_tools(venv: Path) -> Path:
    """The tools venv's python, with ``vllm-router==0.1.17`` and ``py-spy`` installed."""
    py = venv / "bin" / "python"
    probe = f"import importlib.metadata as m; assert m.version('vllm-router') == '{PEER_VERSION}'"
    ok = py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0
    if not ok or not (venv / "bin" / "py-spy").exists():
        print(f"installing vllm-router=={PEER_VERSION} and py-spy into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([str(py), "-m", "ensurepip"], check=True, capture_output=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, f"vllm-router=={PEER_VERSION}", "py-spy"], check=True)
    return py


@dataclass
class Server:
    name: str
    proc: asyncio.subprocess.Process
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def wait_ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float = 120) -> None:
    """Until ``GET url`` answers 200 (the process must stay alive); on failure the process is
    killed before this raises, so nothing outlives a failed start."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline and proc.returncode is None:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    raise RuntimeError(f"{url} did not become ready (exit code {proc.returncode})")


async def spawn(work: Path, name: str, argv: list[str], env: dict[str, str]) -> Any:
    log = await asyncio.to_thread((work / f"{name}.log").open, "wb")
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=log, stderr=log)


async def start_router(work: Path, redis_url: str, namespace: str, workers: int = 1) -> Server:
    """``python -m router`` on a free port against ``namespace``; ready when /healthz is 200."""
    port = free_port()
    env = {
        **os.environ,
        "ROLLOUTPOOL_ROUTER_HOST": "127.0.0.1",
        "ROLLOUTPOOL_ROUTER_PORT": str(port),
        "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
        "ROLLOUTPOOL_ROUTER_WORKERS": str(workers),
        "ROLLOUTPOOL_REDIS_URL": redis_url,
        "ROLLOUTPOOL_REDIS_NAMESPACE": namespace,
    }
    argv = [sys.executable, "-m", "router"] + (["--workers", str(workers)] if workers != 1 else [])
    proc = await spawn(work, f"router-{namespace}-w{workers}", argv, env)
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


async def start_peer(work: Path, python: Path, upstreams: list[str], name: str) -> Server:
    """``vllm-router --policy round_robin`` in front of ``upstreams``; ready when it routes."""
    port = free_port()
    argv = [
        str(python),
        "-m",
        "vllm_router.launch_router",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "round_robin",
        "--log-level", "warning",
        "--prometheus-port", str(free_port()),  # its default is fixed: one per instance
        "--worker-urls", *upstreams,
    ]  # fmt: skip
    proc = await spawn(work, name, argv, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url + "/health", proc)
    return Server("vllm_router", proc, url)


# ------------------------------------------------------------------------------ load


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


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
            "model": "rolloutpool" if name == "rolloutpool" else STUB_MODEL,
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
    order = [ts[p] for p in PATHS]

    def pick(k: int) -> Target:
        return order[k % 3]

    await drive(s, pick, concurrency, max(90, 3 * concurrency), stream, None)  # warm-up
    rec = Record()
    a = meter.snap()
    await drive(s, pick, concurrency, total, stream, rec)
    w = CpuMeter.window(a, meter.snap())
    paths = {p: path_stats(rec, p, w["wall_s"]) for p in PATHS}
    d = paths["direct"]
    out: dict[str, Any] = {"concurrency": concurrency, "stream": stream, "paths": paths}
    for r in ROUTERS:
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
    if t.name in ROUTERS:
        n = len(rec.latency[t.name])
        out["cpu_s_per_1000_requests"] = cpu_per_1000(w, t.name, n)
        out["runqueue_wait_ms_per_request"] = wait_ms_per_request(w, t.name, n)
    return out


# ------------------------------------------------------------------------------ main


def client_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def stub_phases(args: argparse.Namespace, work: Path, tools: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with RedisServer(work / "redis") as redis, StubUpstream() as stub:
        store = RedisStore.connect(StoreSettings(url=redis.url, namespace="peer"))
        await publish_ready(store, [("stub", stub.url)], capacity=1_000_000)
        await store.close()
        assert redis.proc is not None
        servers: list[Server] = []
        try:
            rp = await start_router(work, redis.url, "peer")
            servers.append(rp)
            peer = await start_peer(work, tools, [stub.url], "vllm-router-stub")
            servers.append(peer)
            meter = CpuMeter(
                {
                    "rolloutpool": rp.pid,
                    "vllm_router": peer.pid,
                    "stub": stub.pid,
                    "redis": redis.proc.pid,
                    "client": os.getpid(),
                },
                alone={"client"},
            )
            urls = {"direct": stub.url, "rolloutpool": rp.url, "vllm_router": peer.url}
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
                for p in PATHS:
                    solo[p] = await alone(s, plain[p], meter, args.alone_concurrency, args.alone)
                    print(f"alone {p}: {solo[p]['requests_per_s']} req/s", flush=True)
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
                        tools.parent / "py-spy",
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


def summary_line(r: dict[str, Any]) -> str:
    p = r["paths"]
    return " | ".join(
        f"{n} p50 {p[n]['p50_ms']} p99 {p[n]['p99_ms']} ms {p[n]['requests_per_s']}/s"
        for n in PATHS
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_start = os.getloadavg()
    procs_before = all_processes()
    tools = await asyncio.to_thread(ensure_tools, args.tools_venv)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    t0 = time.monotonic()
    stub = await stub_phases(args, work, tools)
    stub_s = time.monotonic() - t0
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
            work / "e2e", tools, start_router, start_peer, rounds=args.e2e_rounds
        )
    ours = set(descendants(os.getpid()))
    return assemble(
        args,
        stub,
        admission,
        e2e,
        {
            "load_average_start": [round(x, 2) for x in load_start],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "stub_phases_s": round(stub_s, 1),
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
    e2e = old.get("e2e_vllm_bench_serve")
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


def assemble(
    args: argparse.Namespace,
    stub: dict[str, Any],
    admission: float,
    e2e: dict[str, Any] | None,
    machine: dict[str, Any],
) -> dict[str, Any]:
    def added(c: int, router: str) -> float | None:
        run = stub.get(f"c{c}")
        return None if run is None else float(run[router]["added_p50_ms"])

    workers = stub["by_router_workers"]
    per_worker = workers["1"]["requests_per_s_per_worker"] if "1" in workers else None
    head = {
        "added_p50_ms_c1": added(1, "rolloutpool"),
        "peer_added_p50_ms_c1": added(1, "vllm_router"),
        "added_p50_ms_c16": added(16, "rolloutpool"),
        "peer_added_p50_ms_c16": added(16, "vllm_router"),
        "requests_per_s_per_worker": per_worker,
        "admission_pairs_per_s_one_connection": round(admission, 1),
    }
    ours, peer = head["added_p50_ms_c1"], head["peer_added_p50_ms_c1"]
    ours16, peer16 = head["added_p50_ms_c16"], head["peer_added_p50_ms_c16"]
    goals = {
        "added_p50_ms_c1": "<= peer_added_p50_ms_c1 + 0.5",
        "added_p50_ms_c16": "<= 2 x peer_added_p50_ms_c16",
        "requests_per_s_per_worker": ">= 3000",
        "admission_pairs_per_s_one_connection": ">= 2000",
    }
    met = {
        "added_p50_ms_c1": ours is not None and peer is not None and ours <= peer + 0.5,
        "added_p50_ms_c16": ours16 is not None and peer16 is not None and ours16 <= 2 * peer16,
        "requests_per_s_per_worker": per_worker is not None and per_worker >= 3000,
        "admission_pairs_per_s_one_connection": admission >= 2000,
    }
    return {
        **head,
        "goals": goals,
        "goals_met": met,
        "router_workers": {
            "measured": sorted(workers, key=int),
            "by_workers": workers,
            "note": "requests/s of RolloutPool's router alone at concurrency "
            f"{args.alone_concurrency} on the stub, per worker count (python -m router "
            "--workers N: N SO_REUSEPORT processes). On this 2-core box the stub, Redis and "
            "the client share the cores with the workers, so a second worker adds less than a "
            "core's worth",
        },
        "interleaved": {k: v for k, v in stub.items() if k.startswith("c")},
        "interleaved_stream": {k: v for k, v in stub.items() if k.startswith("stream_c")},
        "alone": stub["alone"],
        "where_the_time_goes": stub.get("profile"),
        "e2e_vllm_bench_serve": e2e,
        "client": {
            "how": "this process: one aiohttp ClientSession (keep-alive pool, no limit) on "
            "uvloop, bodies encoded once; `concurrency` asyncio tasks send back to back. Its CPU "
            "is reported as cpu.cores.client in every window: below 1 core, it is not the "
            "bottleneck of a path (the stub and the client share the cores with the routers).",
            "interleaving": "one shared counter: request k goes to direct, rolloutpool, "
            "vllm_router by k % 3, so the three paths see the same load at the same time; a "
            "slower path holds more of the tasks (see mean_in_flight)",
            "requests_per_path": args.requests // 3,
            "stream_requests_per_path": args.stream_requests // 3,
            "alone_seconds_per_path": args.alone,
        },
        "box": machine,
        "setup": "2-core box, everything local: instant aiohttp stub upstream (testkit."
        "stub_upstream, uvloop), redis-server (AOF everysec), python -m router (1 process), "
        f"vllm-router {PEER_VERSION} (--policy round_robin, its own venv), and this client. "
        "Non-streamed: /v1/completions max_tokens 1; streamed: stream=true, 32 one-token SSE "
        "chunks from the stub. Added latency = router percentile minus direct percentile in "
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
