"""What stand-in vLLM replicas cost: memory and idle CPU of many in one process, and how many
requests per second one instance answers on the instant time model.

    python -m bench.standin_cost [--replicas 128] [--idle-s 20] [--requests 4000]

Each server is its own process (``python -m testkit.standin``, as a benchmark would run it); the
figures come from its ``/proc`` entry: resident memory (``VmRSS``) once every replica listens,
and CPU seconds (user + system) over ``--idle-s`` seconds with no traffic. Throughput: this
process sends ``--requests`` requests from ``--concurrency`` aiohttp workers (closed loop, after
a warm-up) to a one-replica server, for each kind of call (non-streamed completions, streamed
completions with usage, ``/inference/v1/generate``; 17 prompt tokens, 16 generated, greedy), and
reports requests/s and the server's CPU milliseconds per request; then the same completions
spread round-robin over all replicas of the many-replica server. The client runs on the other
core of the 2-core box. Writes ``bench/results/standin_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench._meta import write
from rolloutpool.local.models import ensure_model

PROMPT = [0, *range(300, 316)]
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    urls: list[str]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(count: int, model: Path, work: Path) -> Server:
    urls_file = work / f"urls-{count}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testkit.standin", "--count", str(count), "--model", str(model),
         "--urls-file", str(urls_file)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    urls = [proc.stdout.readline().strip() for _ in range(count)]
    if not all(urls):
        proc.kill()
        raise RuntimeError(f"the stand-in server exited with {proc.wait()}")
    return Server(proc, urls)


def idle(server: Server, seconds: float) -> dict[str, float]:
    time.sleep(1.0)  # let start-up settle
    c0, t0 = server.cpu_s(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = server.cpu_s() - c0, time.monotonic() - t0
    return {"rss_mib": round(server.rss_mib(), 1), "idle_cpu_percent": round(100 * cpu / wall, 3)}


async def load(
    server: Server, kind: str, requests: int, concurrency: int, warmup: int = 200
) -> dict[str, float]:
    """Closed loop of ``requests`` calls of ``kind`` over the server's replicas (round-robin)."""
    routes: dict[str, tuple[str, dict[str, Any]]] = {
        "completions": ("/v1/completions", {"prompt": PROMPT}),
        "completions_stream": ("/v1/completions", {"prompt": PROMPT, "stream": True,
                                                   "stream_options": {"include_usage": True}}),
        "generate": ("/inference/v1/generate", {"token_ids": PROMPT}),
    }  # fmt: skip
    path, body = routes[kind]
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    body = {**body, "sampling_params": params} if kind == "generate" else {**body, **params}
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    targets = itertools.cycle([u + path for u in server.urls])
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def run(n: int) -> None:
            left = iter(range(n))

            async def worker() -> None:
                for _ in left:
                    async with http.post(next(targets), data=payload, headers=headers) as r:
                        await r.read()
                        assert r.status == 200, r.status

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await run(warmup)
        c0, t0 = server.cpu_s(), time.perf_counter()
        await run(requests)
        wall, cpu = time.perf_counter() - t0, server.cpu_s() - c0
    return {
        "requests": requests,
        "requests_per_s": round(requests / wall, 1),
        "server_cpu_ms_per_request": round(1000 * cpu / requests, 3),
        "server_cpu_percent": round(100 * cpu / wall, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=128)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args(argv)
    model = ensure_model("random", seed=1)
    result: dict[str, Any] = {"replicas": a.replicas, "concurrency": a.concurrency}
    with tempfile.TemporaryDirectory() as tmp:
        one = start(1, model, Path(tmp))
        try:
            result["one"] = idle(one, a.idle_s)
            result["one"]["load"] = {
                kind: asyncio.run(load(one, kind, a.requests, a.concurrency))
                for kind in ("completions", "completions_stream", "generate")
            }
        finally:
            one.stop()
        many = start(a.replicas, model, Path(tmp))
        try:
            result["many"] = idle(many, a.idle_s)
            result["many"]["load"] = {
                "completions": asyncio.run(load(many, "completions", a.requests, a.concurrency))
            }
        finally:
            many.stop()
    extra = result["many"]["rss_mib"] - result["one"]["rss_mib"]
    result["rss_mib_per_extra_replica"] = round(extra / (a.replicas - 1), 3)
    print(json.dumps(result, indent=1))
    print(write("standin_cost", result))


if __name__ == "__main__":
    main()
