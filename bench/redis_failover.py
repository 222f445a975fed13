"""Redis failovers under rollout load: Sentinel (1 primary, 2 replicas, 3 sentinels), two real
vLLM CPU replicas, the router and the updater (``testkit.scenarios.redis_failover``).

    flock /work/heavy.lock .venv/bin/python -m bench.redis_failover [--per-kind 5]

Writes ``bench/results/redis_failover.json``: a row per failover and the totals
``failovers``, ``cross_generation``, ``silently_lost``, ``max_unavailable_s``,
``fencing_monotonic``, ``updates_after_failover``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench._meta import write
from testkit.scenarios.redis_failover import KINDS, Params, scenario


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.redis_failover")
    ap.add_argument("--per-kind", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    p = Params(per_kind=args.per_kind, kinds=tuple(args.kinds.split(",")))
    with tempfile.TemporaryDirectory(prefix="redis-failover-") as tmp:
        result = asyncio.run(scenario(p, Path(tmp)))
    write("redis_failover", result)
    keys = ("failovers", "cross_generation", "silently_lost", "max_unavailable_s")
    print({k: result[k] for k in (*keys, "fencing_monotonic", "updates_after_failover")})


if __name__ == "__main__":
    main()
