"""Admission throughput: admit+release pairs per second from one process against a local
``redis-server`` (started here, on a free port). Goal: >= 2,000 pairs/s on one core.

    python bench/admission.py [--pairs 20000] [--concurrency 1 16]

Each pair is two atomic scripts (ADMIT, RELEASE), i.e. two round trips. ``concurrency`` is the
number of asyncio tasks in the one process issuing pairs back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench._meta import write
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from testkit.redis_server import RedisServer


async def run(url: str, pairs: int, concurrency: int) -> float:
    store = RedisStore.connect(StoreSettings(url=url, namespace=f"bench{concurrency}"))
    token = await store.updater_lease().acquire()
    await store.register_replica("r0", "http://r0", token, capacity=1_000_000)
    await store.transition(
        "r0",
        token,
        ReplicaState.UNINITIALIZED,
        ReplicaState.READY,
        generation=Generation(number=0, label="g0"),
        publish=True,
    )
    per_task = pairs // concurrency

    async def worker(w: int) -> None:
        for i in range(per_task):
            rid = f"w{w}-{i}"
            await store.admit(rid, "r0")
            await store.release(rid, "r0")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await store.close()
    return per_task * concurrency / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d), appendonly=True) as server:
        rates = {}
        for c in args.concurrency:
            rate = asyncio.run(run(server.url, args.pairs, c))
            rates[str(c)] = round(rate, 1)
            print(f"concurrency {c:>3}: {rate:,.0f} admit+release pairs/s")
    best = max(rates.values())
    write(
        "admission",
        {
            "admissions_per_s": best,
            "admissions_per_s_by_concurrency": rates,
            "pairs": args.pairs,
            "goal_per_s": 2000,
            "setup": "one Python process (asyncio) + local redis-server (AOF everysec) on the "
            "same 2-core box; each pair = ADMIT script + RELEASE script",
        },
    )


if __name__ == "__main__":
    main()
