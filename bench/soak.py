"""Soak: a long mixed load with an update every minute; memory must stay flat, nothing leaks.

    python -m bench.soak [--minutes 20] [--update-every 60]

Setup: a local redis-server; the updater (``python -m updater --config``) and the router
(``python -m router``) as separate processes; 2 vLLM CPU replicas (launched by the updater) on
marker checkpoints. The load mixes single completions, SSE-streamed completions and 3-request
sessions at temperature 1.0. Every ``update_every`` seconds the next marker generation is pushed
through the updater's HTTP API. Afterwards: every rollout's tokens are checked against its bound
generation's marker; every rollout id the clients saw must be ``finished`` or ``aborted`` with a
reason in its provenance record; no binding may remain active; the RSS of the router and the
updater processes is reported at the start (after warm-up) and the end.

The result is merged into ``bench/results/reliability.json`` under ``soak``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from pool.settings import StoreSettings
from pool.store import RedisStore
from rolloutpool.local.models import marker_token
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from testkit.scenarios.rolling import (
    PROBE_PROMPT,
    Params,
    Rollout,
    Run,
    cross_generation,
    marker,
    session,
    single,
    start_router,
    wait_http,
)
from updater.client import UpdaterClient

NAMESPACE = "rolling"  # start_router() points routers at this namespace
TOKEN = "soak-admin-token"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return -1.0


async def streamed(http: httpx.AsyncClient, rng: random.Random, p: Params, run: Run) -> None:
    body = {
        "model": "rolloutpool",
        "prompt": [rng.randrange(3, 2000) for _ in range(8)],
        "max_tokens": p.max_tokens,
        "temperature": 1.0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            run.error(f"stream {r.status_code}")
            return
        rid, gen = r.headers["X-Rollout-Id"], int(r.headers["X-Rollout-Generation"])
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices", []):
                tokens += ch.get("token_ids") or []
    run.rollouts.append(Rollout(rid, "stream", gen, tokens, time.monotonic()))


async def load(url: str, p: Params, run: Run, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            x = rng.random()
            try:
                if x < 0.25:
                    await session(http, rng, p, run)
                elif x < 0.5:
                    await streamed(http, rng, p, run)
                else:
                    await single(http, rng, p, run)
            except (httpx.HTTPError, KeyError) as e:
                run.error(type(e).__name__)
                await asyncio.sleep(0.1)


def updater_config(workdir: Path, redis_url: str, port: int) -> Path:
    base = str(marker(0))
    cfg = {
        "updater": {
            "port": port,
            "admin_token": TOKEN,
            "health_interval_s": 1.0,
            "replicas": [
                {
                    "id": f"r{i}",
                    "model": base,
                    "launch": {
                        "model": base,
                        "name": f"soak-r{i}",
                        "cpu_bind": str(i),
                        "work_dir": str(workdir / f"r{i}"),
                    },
                }
                for i in range(2)
            ],
        },
        "redis": {"url": redis_url, "namespace": NAMESPACE},
    }
    path = workdir / "updater.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_updater(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "updater", "--config", str(config)],
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def soak(minutes: float, update_every: float, workdir: Path) -> dict[str, Any]:
    p = Params(concurrency=4, max_tokens=24)
    n_gen = int(minutes * 60 / update_every) + 3
    await asyncio.gather(*(asyncio.to_thread(marker, g) for g in range(n_gen)))
    redis = RedisServer(workdir / "redis").start()
    store = RedisStore.connect(StoreSettings(url=redis.url, namespace=NAMESPACE))
    uport, rport = free_port(), free_port()
    up_proc = start_updater(updater_config(workdir, redis.url, uport), workdir / "updater.log")
    router = start_router(rport, redis.url, lease_s=10.0)
    run = Run()
    stop = asyncio.Event()
    uurl, rurl = f"http://127.0.0.1:{uport}", f"http://127.0.0.1:{rport}"
    try:
        await wait_http(uurl + "/healthz", timeout_s=400)
        await wait_http(rurl + "/healthz")
        tasks = [asyncio.create_task(load(rurl, p, run, stop, s)) for s in range(p.concurrency)]
        await asyncio.sleep(20)  # warm-up before the first RSS reading
        rss0 = {"router": rss_mb(router.pid), "updater": rss_mb(up_proc.pid)}
        t0 = time.monotonic()
        updates: list[dict[str, Any]] = []
        g = 1
        client = UpdaterClient(uurl, TOKEN)
        try:
            while time.monotonic() - t0 < minutes * 60:
                await asyncio.sleep(max(0.0, t0 + g * update_every - time.monotonic()))
                tok = marker_token(g)
                rec = await asyncio.to_thread(
                    client.push, marker(g), step=g, probe=(PROBE_PROMPT, [tok] * 4)
                )
                done = await asyncio.to_thread(client.wait, rec["id"], 300.0)
                updates.append(done)
                print(
                    f"[{(time.monotonic() - t0) / 60:5.1f} min] g{g} {done['state']}; "
                    f"rollouts {len(run.rollouts)}; rss router {rss_mb(router.pid)} MB "
                    f"updater {rss_mb(up_proc.pid)} MB",
                    flush=True,
                )
                g += 1
        finally:
            client.close()
        rss1 = {"router": rss_mb(router.pid), "updater": rss_mb(up_proc.pid)}
        stop.set()
        await asyncio.gather(*tasks)
        await asyncio.sleep(12)  # leases of anything abandoned expire; the reaper runs
        leaked = sum(r.active for r in await store.replicas())
        states: dict[str, int] = {}
        unaccounted = 0
        for r in run.rollouts:
            b = await store.binding(r.id)
            states[b.state.value] = states.get(b.state.value, 0) + 1
            if b.state.value == "active" or (b.state.value == "aborted" and not b.reason):
                unaccounted += 1
        bad = cross_generation(run.rollouts)
        return {
            "minutes": round((time.monotonic() - t0) / 60, 2),
            "rollouts": len(run.rollouts),
            "rollouts_by_kind": {
                k: sum(1 for r in run.rollouts if r.kind == k)
                for k in ("single", "stream", "session")
            },
            "updates": sum(1 for u in updates if u["state"] == "succeeded"),
            "cross_generation": len(bad),
            "leaked_bindings": leaked,
            "binding_states": states,
            "unaccounted_rollouts": unaccounted,
            "client_errors": run.errors,
            "rss_router_mb_start": rss0["router"],
            "rss_router_mb_end": rss1["router"],
            "rss_updater_mb_start": rss0["updater"],
            "rss_updater_mb_end": rss1["updater"],
        }
    finally:
        stop.set()
        for proc in (router, up_proc):
            terminate(proc, grace_s=60)
        await store.close()
        redis.stop()


def merge_reliability(section: str, value: dict[str, Any]) -> Path:
    """Merge one section into bench/results/reliability.json (other sections kept)."""
    from bench._meta import RESULTS, write

    path = RESULTS / "reliability.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[section] = value
    from rolloutpool.results import _command

    data.setdefault("commands", {})[section] = _command()
    for k in ("date", "command", "machine", "versions"):
        data.pop(k, None)
    return write("reliability", data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--update-every", type=float, default=60.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        result = asyncio.run(soak(args.minutes, args.update_every, Path(d)))
    print(json.dumps(result, indent=2))
    merge_reliability("soak", result)


if __name__ == "__main__":
    main()
