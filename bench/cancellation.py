"""``python -m bench.cancellation``: how often a task cancelled while it calls Redis runs on.

A task pings a real ``redis-server`` in a loop; it is cancelled after a random 0-2 ms; it either
ends with ``CancelledError`` or, having lost the cancellation, finishes 300 more pings. Twice:
through redis-py alone and through the pool's store seam (:meth:`pool.store.RedisStore.call`).
On Python 3.11 redis-py's socket write goes through ``asyncio.wait_for``, which returns
normally when the cancellation lands as the write completes (CPython gh-86296); the seam ends
such a call with ``CancelledError``. Writes ``bench/results/cancellation.json``: per path,
``trials``, ``cancelled``, ``ran_on``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from bench._meta import write
from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.redis_server import RedisServer


async def trials(ping: Callable[[], Awaitable[Any]], n: int, rng: random.Random) -> dict[str, int]:
    async def loop() -> None:
        for _ in range(300):
            await ping()

    out = {"trials": n, "cancelled": 0, "ran_on": 0}
    for _ in range(n):
        task = asyncio.create_task(loop())
        await asyncio.sleep(rng.random() * 0.002)
        task.cancel()
        try:
            await task
            out["ran_on"] += 1
        except asyncio.CancelledError:
            out["cancelled"] += 1
    return out


async def main(n: int) -> dict[str, Any]:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d)).start()
        plain = aredis.Redis.from_url(server.url)
        store = RedisStore.connect(StoreSettings(url=server.url, namespace="bench-cancel"))
        try:
            redis_py = await trials(plain.ping, n, rng)
            seam = await trials(lambda: store.call(store.r.ping), n, rng)
        finally:
            await plain.aclose()
            await store.close()
            server.stop()
    return {"python": sys.version.split()[0], "redis_py": redis_py, "store_seam": seam}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=400)
    print(write("cancellation", asyncio.run(main(ap.parse_args().trials))))
