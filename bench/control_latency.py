"""How late a busy CPU replica answers its control plane.

One real vLLM CPU replica; for ``--seconds`` each, idle and then saturated (``--rollouts``
concurrent ``--max-tokens``-token rollouts, restarted as they finish), ``/health`` and
``/metrics`` are polled every ``--interval`` seconds on fresh connections and their latencies
recorded, and ``/metrics`` also through the :class:`VllmEngine` whose httpx client sends the
load. Why it matters: the supervisor taints a replica whose ``/health`` misses
``health_failures`` times in a row (timeout ``health_timeout_s``, 2 s by default), so a late
``/health`` under load would taint healthy replicas; ``/metrics`` is what the benchmarks poll.

Writes ``bench/results/control_latency.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._meta import write
from pool.engine import VllmEngine
from pool.launcher import LocalReplica, ReplicaSpec
from testkit.scenarios.rolling import marker

TIMEOUT_S = 10.0


def summary(latencies: list[float]) -> dict[str, Any]:
    xs = sorted(latencies)
    return {
        "n": len(xs),
        "p50_s": round(xs[len(xs) // 2], 4),
        "p90_s": round(xs[int(len(xs) * 0.9)], 4),
        "max_s": round(xs[-1], 4),
        "over_1s": sum(x > 1 for x in xs),
        "over_2s": sum(x > 2 for x in xs),
    }


async def poll(url: str, path: str, seconds: float, interval: float) -> list[float]:
    """Latency of ``GET path`` every ``interval`` s for ``seconds`` s; a timeout counts 10 s."""
    out: list[float] = []
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            try:
                (await c.get(path, timeout=TIMEOUT_S)).raise_for_status()
                out.append(time.monotonic() - t)
            except httpx.TimeoutException:
                out.append(TIMEOUT_S)
            await asyncio.sleep(interval)
    return out


async def poll_engine(eng: VllmEngine, seconds: float, interval: float) -> list[float]:
    """Like :func:`poll` for ``/metrics``, through ``eng`` (the client the load also uses)."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        await eng.metrics(timeout_s=TIMEOUT_S)
        out.append(time.monotonic() - t)
        await asyncio.sleep(interval)
    return out


async def scenario(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    rep = LocalReplica(ReplicaSpec(model=marker(0), name="ctl", cpu_bind="0", work_dir=work))
    await rep.start()
    eng = VllmEngine(rep.url, timeout=120)
    result: dict[str, Any] = {}
    try:
        await eng.bootstrap()
        for label, loaded in (("idle", False), ("saturated", True)):
            stop = asyncio.Event()

            async def load(stop: asyncio.Event) -> int:
                done = 0
                while not stop.is_set():
                    await asyncio.gather(
                        *(
                            eng.complete(
                                [3 + i, 4, 5],
                                max_tokens=a.max_tokens,
                                temperature=1.0,
                                timeout_s=120,
                            )
                            for i in range(a.rollouts)
                        )
                    )
                    done += a.rollouts
                return done

            loader = asyncio.create_task(load(stop)) if loaded else None
            if loader is not None:
                await asyncio.sleep(1.0)
            health, metrics, shared = await asyncio.gather(
                poll(rep.url, "/health", a.seconds, a.interval),
                poll(rep.url, "/metrics", a.seconds, a.interval),
                poll_engine(eng, a.seconds, a.interval),
            )
            stop.set()
            done = await loader if loader is not None else 0
            result[label] = {
                "health": summary(health),
                "metrics": summary(metrics),
                "metrics_via_load_client": summary(shared),
                "rollouts_completed": done,
            }
            print(label, result[label], flush=True)
    finally:
        await eng.aclose()
        await rep.stop()
    result["params"] = {
        "rollouts": a.rollouts,
        "max_tokens": a.max_tokens,
        "seconds": a.seconds,
        "interval_s": a.interval,
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=480)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=0.5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ctl-latency-") as d:
        write("control_latency", asyncio.run(scenario(a, Path(d))))


if __name__ == "__main__":
    main()
