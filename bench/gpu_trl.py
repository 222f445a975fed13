"""TRL's ``GRPOTrainer`` pushing from GPU memory into 2 replicas on its own GPU.

Runs on the GPU host (``tests/gpu/README.md``), never in CI. The setup of
:mod:`testkit.scenarios.trl_grpo` (embedded pool, the tiny model, the "ids divisible by 4"
reward) with the trainer and 2 vLLM 0.26 replicas on GPU 0, the pool's transport
``ipc_direct`` (replicas with RolloutPool's worker extension; ``min_serving`` 0, so a pool of
two still updates while one replica recovers), and
:class:`~rolloutpool.integrations.trl.PoolLink` with ``weights_from="gpu_memory"`` and
``wait=False``: each update stages the weights on the GPU and returns; the checkpoint written
from the staged copy is the generation's recovery source.

**Recovery, mid-run.** At step ``--taint-at`` a callback taints ``replica-1`` in the store (as
a router or an operator would); the updater's supervisor restarts it (a fresh process) and
loads the latest generation from scratch (the staged copy while the trainer still holds it,
else the confirmed checkpoint) and validates it. The run then waits (up to ``--recover-s``)
until that replica is READY on the pool's latest generation with a new process, and records
how it was loaded.

Writes ``--out`` (``bench/results/trl_grpo_gpu.json``; ``python -m bench.gpu_trl merge RAW``
does the same here from a run's ``--raw`` file): the fields of the issue (``weights_from``,
``transport``, ``stall_s_mean``, ``staging_copy_s``, ``cross_generation``,
``recovery_tested``) on top of what the file held (the checkpoint-push runs), the whole run
under ``gpu_memory_run``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from bench.gpu.harness import (
    RESULTS,
)
from rolloutpool.embedded import EmbeddedPool, PoolConfig
from testkit.scenarios.trl_grpo import GPU_REPLICA, Params, _prompts, _summary

T = TypeVar("T")
TAINTED = "replica-1"


def replica() -> dict[str, Any]:
    """:data:`GPU_REPLICA` with the worker extension and eager mode (quicker restarts)."""
    extra = [*GPU_REPLICA["extra_args"]]
    extra += ["--worker-extension-cls", "pool.replica_extension.WeightExtension"]
    return {**GPU_REPLICA, "extra_args": extra, "enforce_eager": True}


class Taint:
    """Taints a replica through the pool's store at one step and follows its recovery; its
    methods run in the training thread (the store's calls go to the pool's ``loop``)."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop, at_step: int) -> None:
        self.store, self.loop, self.at_step = store, loop, at_step
        self.before: dict[str, Any] | None = None
        self.t_taint: float | None = None

    def call(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)  # type: ignore[arg-type]

    def record(self) -> Any:
        return self.call(self.store.replica(TAINTED))

    def taint(self) -> None:
        rec = self.record()
        self.before = {
            "state": rec.state.value,
            "generation": rec.generation,
            "process": rec.process,
        }
        self.call(self.store.taint(TAINTED, "bench: tainted mid-run", source="operator"))
        self.t_taint = time.monotonic()

    def wait_recovered(self, timeout_s: float) -> dict[str, Any]:
        """Poll until the replica is READY on the latest generation in another process."""
        assert self.before is not None and self.t_taint is not None
        deadline = time.monotonic() + timeout_s
        rec = self.record()
        latest = None
        while time.monotonic() < deadline:
            rec = self.record()
            latest = self.call(self.store.latest())
            if (
                rec.state.value == "READY"
                and latest is not None
                and rec.generation == latest[0].number
                and rec.process != self.before["process"]
            ):
                break
            time.sleep(0.5)
        recovered = rec.state.value == "READY" and rec.process != self.before["process"]
        return {
            "replica": TAINTED,
            "tainted_at_step": self.at_step,
            "before": self.before,
            "after": {
                "state": rec.state.value,
                "generation": rec.generation,
                "process": rec.process,
            },
            "latest_generation": None if latest is None else latest[0].number,
            "recovered": recovered,
            "on_latest": latest is not None and rec.generation == latest[0].number,
            "taint_to_ready_s": round(time.monotonic() - self.t_taint, 1),
        }


def train(
    p: Params, model: Path, pool: EmbeddedPool, workdir: Path, taint: Taint
) -> dict[str, Any]:
    """``GRPOTrainer`` from GPU memory (blocking; off the pool's loop)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from rolloutpool.integrations.trl import PoolLink
    from testkit.scenarios.trl_grpo import reward_divisible_by_4

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    dataset = Dataset.from_dict(
        {"prompt": _prompts(tokenizer, p.steps * p.prompts_per_step, p.seed)}
    )
    scored: list[tuple[int, float]] = []

    def divisible_by_4(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
        rewards = reward_divisible_by_4(completion_ids)
        scored.extend(zip(kw["rollout_generation"], rewards, strict=True))
        return list(rewards)

    class TaintAt(TrainerCallback):
        """At the step: let the update in flight end (so the taint cannot fail it), then
        taint. The next updates roll the other replica meanwhile (``min_serving`` 0)."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if int(state.global_step) == taint.at_step:
                link._settle()
                taint.taint()

    link = PoolLink(
        pool.router_url,
        pool.updater_url,
        admin_token=pool.admin_token,
        checkpoint_dir=workdir / "ckpts",
        push_every=p.push_every,
        wait=p.wait,
        sampling={"ignore_eos": True},
        require_spans=False,
        probe={"margin": 0.03},
        weights_from="gpu_memory",
    )
    args = GRPOConfig(
        output_dir=str(workdir / "trainer"),
        max_steps=p.steps,
        per_device_train_batch_size=p.prompts_per_step * p.num_generations,
        num_generations=p.num_generations,
        max_completion_length=p.max_completion_length,
        learning_rate=p.learning_rate,
        lr_scheduler_type="constant",
        temperature=1.0,
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_pin_memory=False,
        seed=p.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=link.reward(divisible_by_4),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=link.rollout_func,
        callbacks=[link.callback, TaintAt()],
    )
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        link.close()
    out = _summary(p, link, trainer.state.log_history, scored, time.monotonic() - t0)
    copies = [u.staging_copy_s for u in link.updates if u.step > 0 and u.staging_copy_s]
    out["staging_copy_s"] = {
        "mean": round(statistics.fmean(copies), 4) if copies else None,
        "max": round(max(copies), 4) if copies else None,
    }
    out["stalls_s"] = [round(u.stall_s, 4) for u in link.updates if u.step > 0]
    return out


async def scenario(p: Params, workdir: Path, taint_at: int, recover_s: float) -> dict[str, Any]:
    pool = EmbeddedPool(
        PoolConfig(
            workdir=workdir / "pool",
            fresh=True,
            model_init_std=0.02,
            router_port=0,
            updater_port=0,
            replica=replica(),
            updater={"transport": "ipc_direct", "min_serving": 0},
        )
    )
    try:
        await pool.start()
        assert pool.model is not None
        from pool.settings import StoreSettings
        from pool.store import RedisStore

        assert pool.redis is not None
        store = RedisStore.connect(
            StoreSettings(url=pool.redis.url, namespace=pool.config.namespace)
        )
        taint = Taint(store, asyncio.get_running_loop(), taint_at)
        result = await asyncio.to_thread(train, p, pool.model, pool, workdir / "run", taint)
        result["recovery"] = await asyncio.to_thread(taint.wait_recovered, recover_s)
        result["recovery"]["loaded_by"] = recovery_path(pool)
        await taint.store.close()
    finally:
        await pool.stop()
    return result


def recovery_path(pool: EmbeddedPool) -> dict[str, Any] | None:
    """How the updater's transport last loaded the tainted replica (``ipc_direct`` from the
    staged copy, or ``reload`` from the confirmed checkpoint)."""
    from updater.app import UPDATER

    updater = pool._runners[0].app[UPDATER]
    url = updater.replicas[TAINTED].handle.engine.url
    last: dict[str, dict[str, Any]] = getattr(updater.runner.transport, "last", {})
    got = last.get(url)
    return None if got is None else {k: v for k, v in got.items() if k != "receive"}


def merge(run: dict[str, Any], previous: Path) -> dict[str, Any]:
    """The committed result with the issue's fields from ``run`` on top, ``run`` whole under
    ``gpu_memory_run``; every other field kept."""
    out: dict[str, Any] = json.loads(previous.read_text()) if previous.is_file() else {}
    rec = run["recovery"]
    out.update(
        weights_from="gpu_memory",
        transport="ipc_direct",
        stall_s_mean=run["stall_s"]["mean"],
        staging_copy_s=run["staging_copy_s"]["mean"],
        cross_generation=run["cross_generation"],
        recovery_tested=bool(rec["recovered"] and rec["on_latest"]),
        gpu_memory_run=run,
        note_fields=(
            "weights_from .. recovery_tested and gpu_memory_run: the run from GPU memory "
            "(bench/gpu_trl.py, wait=False); the other top-level fields and async_run: the "
            "earlier checkpoint-push runs (bench/trl_grpo.py --gpu)"
        ),
    )
    return out


def main() -> None:
    if sys.argv[1:2] == ["merge"]:  # back here, from the run's --raw file
        m = argparse.ArgumentParser(prog="python -m bench.gpu_trl merge")
        m.add_argument("raw", type=Path)
        m.add_argument("--out", type=Path, default=RESULTS / "trl_grpo_gpu.json")
        ma = m.parse_args(sys.argv[2:])
        merged = merge(json.loads(ma.raw.read_text()), ma.out)
        ma.out.write_text(json.dumps(merged, indent=1, default=str) + "\n")
        print(f"wrote {ma.out}")
        return
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_trl", description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--push-every", type=int, default=2)
    ap.add_argument("--taint-at", type=int, default=7)
    ap.add_argument("--recover-s", type=float, default=240.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "trl_grpo_gpu.json")
    ap.add_argument("--raw", type=Path, help="also write the run alone here")
    args = ap.parse_args()
    p = Params(steps=args.steps, push_every=args.push_every, wait=False, gpu=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trl-gpu-mem-") as d:
        run = asyncio.run(scenario(p, Path(d), args.taint_at, args.recover_s))
    import torch

    run.update(wall_s=round(time.monotonic() - t0, 1), gpu=torch.cuda.get_device_name(0))
    if args.raw is not None:
        args.raw.write_text(json.dumps(run, indent=1, default=str) + "\n")
    args.out.write_text(json.dumps(merge(run, args.out), indent=1, default=str) + "\n")
    keys = ("steps", "updates", "reward_first", "reward_last", "cross_generation", "stall_s")
    print({k: run.get(k) for k in keys}, run["staging_copy_s"], run["recovery"], flush=True)


if __name__ == "__main__":
    main()
