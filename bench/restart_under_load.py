"""How long a replica restart takes while the other replica is saturated.

Two real vLLM CPU replicas (cores 0 and 1). r1 is SIGKILLed and restarted by the launcher —
what the updater's recovery does — first with the host idle, then ``--restarts`` times while
``--rollouts`` concurrent ``--max-tokens``-token streams keep r0 busy. Records each start's
seconds, the launcher's tries (``count_launches``) and the host's CPU pressure
(``/proc/pressure/cpu``, ``some avg60``). Why it matters: the restarting process imports vLLM
three times (API server, EngineCore, worker) at a fraction of a core; a fixed startup deadline
killed such starts halfway (see ``ReplicaSpec.startup_timeout_s`` for the progress rule).

Writes ``bench/results/restart_under_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench._meta import write
from pool.launcher import LaunchError, LocalReplica, ReplicaSpec, count_launches
from testkit.scenarios.rolling import marker


def cpu_pressure() -> float | None:
    """``some avg60`` of ``/proc/pressure/cpu`` (percent), None where PSI is unavailable."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return None
    return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])


async def stream_forever(url: str, model: str, max_tokens: int, stop: asyncio.Event) -> int:
    done = 0
    body = {
        "model": model,
        "prompt": [3, 4, 5],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        while not stop.is_set():
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                done += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
    return done


async def restart(r1: LocalReplica) -> dict[str, Any]:
    before = count_launches(r1.log_path)
    r1.kill(signal.SIGKILL)
    try:
        took: float | None = round(await r1.restart(), 1)
        error = None
    except LaunchError as e:
        took, error = None, str(e).splitlines()[0]
    return {
        "startup_s": took,
        "launches": count_launches(r1.log_path) - before,
        "cpu_pressure_avg60": cpu_pressure(),
        "error": error,
    }


async def scenario(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = marker(0)
    r0, r1 = (
        LocalReplica(
            ReplicaSpec(model=model, name=f"r{i}", cpu_bind=str(i), work_dir=work / f"r{i}")
        )
        for i in range(2)
    )
    await asyncio.gather(r0.start(), r1.start())
    stop = asyncio.Event()
    loads: list[asyncio.Task[int]] = []
    try:
        idle = await restart(r1)
        print("idle", idle, flush=True)
        loads = [
            asyncio.create_task(stream_forever(r0.url, str(model), a.max_tokens, stop))
            for _ in range(a.rollouts)
        ]
        await asyncio.sleep(10)
        loaded = []
        for i in range(a.restarts):
            loaded.append(await restart(r1))
            print(i, loaded[-1], flush=True)
    finally:
        stop.set()
        for t in loads:
            t.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        await asyncio.gather(r0.stop(), r1.stop())
    ok = [x["startup_s"] for x in loaded if x["startup_s"] is not None]
    spec = r1.spec
    return {
        "idle": idle,
        "under_load": loaded,
        "summary": {
            "restarts": len(loaded),
            "failed": len(loaded) - len(ok),
            "extra_launches": sum(x["launches"] - 1 for x in loaded),
            "startup_s_min": min(ok, default=None),
            "startup_s_median": statistics.median(ok) if ok else None,
            "startup_s_max": max(ok, default=None),
            "ratio_median_to_idle": (
                round(statistics.median(ok) / idle["startup_s"], 2)
                if ok and idle["startup_s"]
                else None
            ),
        },
        "params": {
            "rollouts": a.rollouts,
            "max_tokens": a.max_tokens,
            "startup_timeout_s": spec.startup_timeout_s,
            "startup_stall_s": spec.startup_stall_s,
            "startup_max_s": spec.startup_max_s,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=6)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=480)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart-load-") as d:
        write("restart_under_load", asyncio.run(scenario(a, Path(d))))


if __name__ == "__main__":
    main()
