"""``python -m bench.redis_memory``: Redis memory per rollout, and the steady state it implies.

Runs ``--rollouts`` single-request rollouts (ADMIT + RELEASE through the real store scripts, as
the router does) against a fresh ``redis-server`` and reads ``INFO memory`` before and after,
separating what a finished rollout keeps until ``binding_retention_s`` expires (its binding hash)
from what the capped journal keeps (two stream entries per rollout, ``journal_maxlen`` at most).
Then computes the steady state for ``--rate`` rollouts/s with the store's default settings:

    steady_bytes = rate * binding_retention_s * binding_bytes  +  journal_maxlen * entry_bytes
                   + fixed (replicas, generations, counters: measured as the empty pool)

and writes ``bench/results/redis_memory.json`` (``bytes_per_rollout``,
``steady_state_bytes_at_100_rollouts_per_s``, the inputs). A check follows: a run at
``--check-rate`` rollouts/s for ``--check-s`` seconds with a short retention and journal cap,
whose memory must level off at the formula's value for those settings (``check``).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench._meta import write
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from testkit.redis_server import RedisServer


async def used_memory(store: RedisStore) -> int:
    info = await store.r.info("memory")
    return int(info["used_memory"])


async def run_rollouts(store: RedisStore, n: int, concurrency: int = 32) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            rid = f"ro-{uuid.uuid4().hex}"  # the router's id format
            await store.admit(rid, "replica-0")
            await store.release(rid, "replica-0", prompt_tokens=32, completion_tokens=32)

    await asyncio.gather(*(one() for _ in range(n)))


async def steady_check(
    args: argparse.Namespace, per_binding: float, per_entry: float
) -> dict[str, Any]:
    """Rollouts at a fixed rate with a short retention: memory must level off at the formula."""
    retention, maxlen = 5.0, 2000
    with tempfile.TemporaryDirectory(prefix="redis-steady-") as d, RedisServer(Path(d)) as redis:
        settings = StoreSettings(
            url=redis.url, namespace="mem", binding_retention_s=retention, journal_maxlen=maxlen
        )
        store = RedisStore.connect(settings)
        try:
            await ready(store)
            fixed = await used_memory(store)
            samples: list[int] = []
            for _ in range(int(args.check_s)):
                t0 = asyncio.get_running_loop().time()
                await run_rollouts(store, int(args.check_rate))
                samples.append(await used_memory(store))
                spent = asyncio.get_running_loop().time() - t0
                await asyncio.sleep(max(0.0, 1.0 - spent))
        finally:
            await store.close()
    predicted = args.check_rate * retention * per_binding + maxlen * per_entry + fixed
    late = samples[len(samples) // 2 :]
    return {
        "rate_rollouts_per_s": args.check_rate,
        "seconds": args.check_s,
        "binding_retention_s": retention,
        "journal_maxlen": maxlen,
        "predicted_bytes": round(predicted),
        "observed_bytes_second_half_max": max(late),
        "observed_over_predicted": round(max(late) / predicted, 3),
        "samples_bytes": samples,
    }


async def ready(store: RedisStore) -> None:
    lease = store.updater_lease("bench")
    token = await lease.acquire()
    await store.register_replica("replica-0", "http://replica-0:8000", token, 10**6)
    await store.transition(
        "replica-0",
        token,
        ReplicaState.UNINITIALIZED,
        ReplicaState.READY,
        generation=Generation(number=0, label="g0"),
        identity_digest="wid:" + "0" * 32,
        publish=True,
    )


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    defaults = StoreSettings()
    with tempfile.TemporaryDirectory(prefix="redis-memory-") as d, RedisServer(Path(d)) as redis:
        settings = StoreSettings(url=redis.url, namespace="mem")
        store = RedisStore.connect(settings)
        try:
            await ready(store)
            fixed = await used_memory(store)
            await run_rollouts(store, args.rollouts)
            with_all = await used_memory(store)
            stream = int(await store.r.memory_usage(store.k.journal) or 0)
            bindings = with_all - fixed - stream
            entries = int(await store.r.xlen(store.k.journal))
            per_binding = bindings / args.rollouts
            per_entry = stream / entries
        finally:
            await store.close()
    per_rollout = per_binding + 2 * per_entry
    retention, maxlen = defaults.binding_retention_s, defaults.journal_maxlen
    steady = args.rate * retention * per_binding + maxlen * per_entry + fixed
    return {
        "rollouts": args.rollouts,
        "bytes_per_rollout": round(per_rollout),
        "bytes_per_binding": round(per_binding),
        "bytes_per_journal_entry": round(per_entry),
        "journal_entries_per_rollout": 2,
        "fixed_bytes": fixed,
        "binding_retention_s": retention,
        "journal_maxlen": maxlen,
        "rate_rollouts_per_s": args.rate,
        "steady_state_bytes_at_100_rollouts_per_s": round(
            100 * retention * per_binding + maxlen * per_entry + fixed
        ),
        "steady_state_bytes_at_rate": round(steady),
        "formula": (
            "rate * binding_retention_s * bytes_per_binding + journal_maxlen * "
            "bytes_per_journal_entry + fixed_bytes"
        ),
        "check": await steady_check(args, per_binding, per_entry),
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.redis_memory", description=__doc__)
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=100.0, help="rollouts/s for the steady state")
    ap.add_argument("--check-rate", type=float, default=300.0)
    ap.add_argument("--check-s", type=float, default=20.0)
    result = asyncio.run(measure(ap.parse_args()))
    write("redis_memory", result)
    print({k: v for k, v in result.items() if k not in ("formula", "check")})
    print({k: v for k, v in result["check"].items() if k != "samples_bytes"})


if __name__ == "__main__":
    main()
