"""``python -m bench.rolling_update_cpu``: the rolling-update scenario
(:mod:`testkit.scenarios.rolling`) under load with faults; writes
``bench/results/rolling_update_cpu.json``."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench._meta import write
from testkit.scenarios.rolling import Params, scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=6)
    args = ap.parse_args()
    p = Params(rollouts=args.rollouts, generations=args.generations, concurrency=args.concurrency)
    with tempfile.TemporaryDirectory(prefix="rolling-") as d:
        result = asyncio.run(scenario(p, Path(d)))

    write("rolling_update_cpu", result)
    keys = (
        "rollouts",
        "updates",
        "cross_generation",
        "min_admitting_replicas",
        "throughput_ratio_during_update",
        "leaked_bindings",
    )
    print({k: result[k] for k in keys})
    print("unsafe_keep_mode:", result.get("unsafe_keep_mode"))
    print("faults:", result.get("faults"))


if __name__ == "__main__":
    main()
