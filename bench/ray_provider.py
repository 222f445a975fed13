"""The Ray provider's full run: placement, rolling updates under load, an actor kill and a node
loss on a 2-node Ray cluster of this machine (see :mod:`testkit.scenarios.ray_provider`).

    flock /work/heavy.lock .venv/bin/python -m bench.ray_provider [--generations 4]

Writes ``bench/results/ray_provider.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from bench._meta import write
from testkit.scenarios.ray_provider import Params, scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    p = Params(generations=args.generations, concurrency=args.concurrency, steady_s=8.0, gap_s=3.0)
    with tempfile.TemporaryDirectory(prefix="rp-ray-") as tmp:
        result = asyncio.run(scenario(p, Path(tmp)))
    write("ray_provider", result)
    keys = ("nodes", "place_s", "rollouts", "cross_generation", "min_admitting_replicas")
    print({k: result.get(k) for k in keys})
    print("actor kill:", result["actor_kill"])
    print("node loss:", result.get("node_loss"))
    ok = (
        result["cross_generation"] == 0
        and result["actor_kill_recovered"]
        and result["node_loss_handled"]
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
