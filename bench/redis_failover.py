"""Redis failovers under rollout load: Sentinel (1 primary, 2 replicas, 3 sentinels), two real
vLLM CPU replicas, the router and the updater (``testkit.scenarios.redis_failover``).

    flock /work/heavy.lock .venv/bin/python -m bench.redis_failover [--per-kind 5]

Writes ``bench/results/redis_failover.json``: a row per failover and the totals
``failovers``, ``cross_generation``, ``silently_lost``, ``max_unavailable_s``,
``fencing_monotonic``, ``updates_after_failover``; and ``wait_cost``: what ``WAIT 1`` costs on
the same kind of group (no vLLM, one connection, sequential calls): admit+release pairs per
second without and with a ``WAIT`` after each ADMIT (the alternative to the routers' epoch
check), and the latency of a fenced transition without and with it (what the updater pays).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._meta import write
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from testkit.redis_ha import SentinelGroup
from testkit.scenarios.redis_failover import KINDS, Params, scenario

S = ReplicaState


async def _ready(store: RedisStore) -> int:
    token = await store.updater_lease("cost").acquire()
    await store.register_replica("r0", "http://r0", token, capacity=10**6)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=Generation(number=0, label="g0"),
        identity_digest="i", publish=True,
    )  # fmt: skip
    return token


async def _pairs(store: RedisStore, n: int, wait: bool) -> float:
    """admit+release pairs per second; ``wait``: each ADMIT followed by WAIT 1."""
    k = store.k
    t0 = time.perf_counter()
    for i in range(n):
        rid = f"c{wait:d}-{i}"
        if wait:
            keys = [k.replica("r0"), k.active("r0"), k.binding(rid), k.leases, k.latest]
            keys += [k.journal, k.gen_admissions]
            args = [rid, "r0", 30_000, 0, -1, -1, 0, store.settings.journal_maxlen]
            await store.run_durable(store._admit, keys, args)  # the ADMIT script, then WAIT 1
        else:
            await store.admit(rid, "r0")
        await store.release(rid, "r0")
    return n / (time.perf_counter() - t0)


async def _transitions(store: RedisStore, token: int, n: int) -> list[float]:
    await store.taint("r0", "cost", source="bench")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await store.transition("r0", token, S.TAINTED, S.TAINTED, reason="cost")
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def wait_cost(workdir: Path, n: int = 2000) -> dict[str, Any]:
    group = await asyncio.to_thread(SentinelGroup(workdir, down_after_ms=5000).start)
    stores = [RedisStore.connect(group.store_settings(f"cost{w}", wait_replicas=w)) for w in (0, 1)]
    try:
        tokens = [await _ready(s) for s in stores]
        plain = await _pairs(stores[0], n, wait=False)
        waited = await _pairs(stores[1], n, wait=True)
        t_plain = await _transitions(stores[0], tokens[0], n // 4)
        t_wait = await _transitions(stores[1], tokens[1], n // 4)
    finally:
        for s in stores:
            await s.close()
        await asyncio.to_thread(group.stop)
    return {
        "pairs_per_s_no_wait": round(plain),
        "pairs_per_s_wait_after_admit": round(waited),
        "admission_throughput_ratio": round(waited / plain, 3),
        "transition_ms_p50_no_wait": round(statistics.median(t_plain), 3),
        "transition_ms_p50_wait": round(statistics.median(t_wait), 3),
        "transition_ms_p99_wait": round(sorted(t_wait)[int(len(t_wait) * 0.99)], 3),
        "calls": n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.redis_failover")
    ap.add_argument("--per-kind", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    p = Params(per_kind=args.per_kind, kinds=tuple(args.kinds.split(",")))
    with tempfile.TemporaryDirectory(prefix="redis-failover-") as tmp:
        cost = asyncio.run(wait_cost(Path(tmp) / "cost"))
        print(f"wait cost: {cost}", flush=True)
        result = asyncio.run(scenario(p, Path(tmp) / "scenario"))
    result["wait_cost"] = cost
    write("redis_failover", result)
    keys = ("failovers", "cross_generation", "silently_lost", "max_unavailable_s")
    print({k: result[k] for k in (*keys, "fencing_monotonic", "updates_after_failover")})


if __name__ == "__main__":
    main()
