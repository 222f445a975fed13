"""What one rollout through RolloutPool's router costs Redis, and what its request waits for.

:func:`measure` runs a fixed number of one-request rollouts through the router, once under
``MONITOR`` (every command clients sent, and every command scripts ran, by name) after an
equally long idle window (the background: heartbeats, the change feed's safety net, reapers),
and reads the router's ``rolloutpool_router_path_round_trips_total`` before and after: the Redis
round trips requests waited for before their answer (ADMIT and RELEASE without grants; a grant
grown because no slot was free). Commands per rollout = (commands in the load window - the idle
rate x its length) / rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import redis.asyncio as aioredis

METRIC = "rolloutpool_router_path_round_trips_total"


async def path_round_trips(router_url: str) -> float:
    """The router's counter of round trips on requests' paths (all calls)."""
    async with aiohttp.ClientSession() as s, s.get(router_url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(METRIC)
    )


async def _monitored(
    url: str, work: Callable[[], Awaitable[Any]]
) -> tuple[Counter[str], Counter[str], float]:
    """(commands sent by clients, commands run by scripts, wall seconds) while ``work`` runs."""
    sent: Counter[str] = Counter()
    scripted: Counter[str] = Counter()
    stop = asyncio.Event()
    r = aioredis.Redis.from_url(url)

    async def watch() -> None:
        async with r.monitor() as m:
            started.set()
            while not stop.is_set():
                try:
                    ev = await asyncio.wait_for(m.next_command(), 0.2)
                except TimeoutError:
                    continue
                name = str(ev["command"]).split(" ", 1)[0].strip('"').lower()
                (scripted if ev.get("client_type") == "lua" else sent)[name] += 1

    started = asyncio.Event()
    task = asyncio.create_task(watch())
    try:
        await started.wait()
        t0 = time.monotonic()
        await work()
        wall = time.monotonic() - t0
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await task
        await r.aclose()
    return sent, scripted, wall


async def measure(
    redis_url: str,
    router_url: str,
    send: Callable[[], Awaitable[None]],
    requests: int,
    concurrency: int,
    idle_s: float = 5.0,
) -> dict[str, Any]:
    """See the module docstring. ``send`` makes one non-streamed request to the router."""
    idle_sent, idle_scripted, idle_wall = await _monitored(redis_url, lambda: asyncio.sleep(idle_s))
    before = await path_round_trips(router_url)
    done = 0

    async def load() -> None:
        nonlocal done

        async def worker() -> None:
            nonlocal done
            while done < requests:
                done += 1
                await send()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.sleep(0.2)  # the records written after delivery (flushed every 20 ms)

    sent, scripted, wall = await _monitored(redis_url, load)
    after = await path_round_trips(router_url)
    idle_rate = sum(idle_sent.values()) / idle_wall
    idle_script_rate = sum(idle_scripted.values()) / idle_wall

    def per(n: float) -> float:
        return round(n / done, 3)

    return {
        "rollouts": done,
        "concurrency": concurrency,
        "redis_round_trips_on_request_path": per(after - before),
        "commands_sent_per_rollout": per(sum(sent.values()) - idle_rate * wall),
        "commands_sent_per_rollout_by_name": {
            k: per(v - idle_sent.get(k, 0) / idle_wall * wall) for k, v in sent.most_common(8)
        },
        "commands_in_scripts_per_rollout": per(sum(scripted.values()) - idle_script_rate * wall),
        "idle_commands_sent_per_s": round(idle_rate, 1),
        "idle_commands_in_scripts_per_s": round(idle_script_rate, 1),
        "load_wall_s": round(wall, 2),
        "how": "MONITOR over the load window minus the idle window's rate (same router, no "
        "load, just before); round trips on the path from the router's own counter",
    }
