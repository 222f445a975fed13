"""``python -m bench.trl_grpo``: TRL's unmodified ``GRPOTrainer`` training through the pool
(:mod:`testkit.scenarios.trl_grpo`); writes ``bench/results/trl_grpo.json``.

Two runs, one after the other, on one embedded pool (2 vLLM CPU replicas), same task, data and
seed, differing only in the update mode of :class:`rolloutpool.integrations.trl.PoolLink`:

* top level: ``wait=True`` (the default): each pushed checkpoint has rolled over both replicas
  before the next step generates, so samples are at most ``push_every - 1`` steps behind;
* ``async_run``: ``wait=False``: the step continues while the replicas update (rollouts in
  flight during the rolling update), waiting for the previous update only before the next push.

``stall_ratio_async_over_sync`` compares the mean trainer stall per update of the two.

``--gpu`` (on the GPU host, after ``source tests/gpu/gpu_env.sh`` with the TRL parts of
``tests/gpu/prepare_trl.sh``): the same runs with the trainer on GPU 0 and 2 vLLM 0.26 replicas
sharing that GPU (:data:`testkit.scenarios.trl_grpo.GPU_REPLICA`); writes
``bench/results/trl_grpo_gpu.json``. Policy updates are checkpoint pushes there too: TRL's
NCCL weight sync (or the pool's, from the trainer's memory) needs the trainer on a GPU no
replica uses.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import tempfile
import time
from pathlib import Path

from bench._meta import write
from testkit.scenarios.trl_grpo import Params, scenario


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--push-every", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="trainer and replicas on GPU 0")
    args = ap.parse_args()
    runs = [
        Params(steps=args.steps, push_every=args.push_every, wait=True, gpu=args.gpu),
        Params(steps=args.steps, push_every=args.push_every, wait=False, gpu=args.gpu),
    ]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as d:
        sync, async_run = asyncio.run(scenario(runs, Path(d)))
    stall_sync, stall_async = sync["stall_s"]["mean"], async_run["stall_s"]["mean"]
    result = {
        **sync,
        "transformers_version": importlib.metadata.version("transformers"),
        "async_run": async_run,
        "stall_ratio_async_over_sync": (
            round(stall_async / stall_sync, 3) if stall_sync and stall_async is not None else None
        ),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if args.gpu:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    write("trl_grpo_gpu" if args.gpu else "trl_grpo", result)
    keys: tuple[str, ...] = ("steps", "updates", "reward_first", "reward_last", "cross_generation")
    keys += ("samples_with_generation", "outside_committed", "stall_s")
    for name, r in (("wait=True", sync), ("wait=False", async_run)):
        print(name, {k: r[k] for k in keys})


if __name__ == "__main__":
    main()
