"""TRL's ``GRPOTrainer``, unmodified, training through an embedded pool on CPU.

    python -m bench.trl_grpo            # full run; bench/results/trl_grpo.json

Setup: :class:`~rolloutpool.embedded.EmbeddedPool` (local redis-server, 2 real vLLM CPU
replicas of the tiny model built with ``init_std`` 0.02 — a near-uniform policy, as in the demo —
the updater and the router, on free ports). The trainer is ``trl.GRPOTrainer`` on its own copy of
the same model, connected by :class:`rolloutpool.integrations.trl.PoolLink`: generations through
the router (``rollout_func``), a checkpoint pushed to the updater every ``push_every`` steps
(callback) and rolled over both replicas. The task is the demo's: prompts of random text, reward =
fraction of completion tokens whose id is divisible by 4 (a uniform policy scores 0.25).

Measured from TRL's side: the reward TRL logged per step (``reward_first``/``reward_last`` are
the means of the first and last ``window`` steps); every sample TRL trained on and the generation
the hook recorded for it (``samples_with_generation``, the fraction with one, must be 1.0);
``cross_generation``: samples whose vLLM ``weight_versions`` spans name anything but their bound
label, plus answers the router refused as provenance violations (must be 0);
``outside_committed``: samples whose generation, label or identity is not one of the updates
this trainer pushed and saw succeed (must be 0); per update the trainer's stall and the time
until both replicas served it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import random
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rolloutpool.embedded import EmbeddedPool, PoolConfig


@dataclass(frozen=True)
class Params:
    steps: int = 40
    push_every: int = 2
    wait: bool = True
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 8
    learning_rate: float = 1e-2
    window: int = 3  # steps averaged for reward_first / reward_last
    seed: int = 0
    #: vLLM 0.26 GPU replicas (:data:`GPU_REPLICA`) instead of the CPU ones; the trainer takes
    #: GPU 0 too (TRL picks CUDA when it is there)
    gpu: bool = False


#: ``PoolConfig.replica`` on the GPU host: vLLM 0.26 replicas sharing GPU 0 with the trainer
#: (``/inference/v1/generate`` needs no flag there and reports no weight_versions spans).
GPU_REPLICA: dict[str, Any] = {
    "flavor": "gpu",
    "cuda_visible_devices": "0",
    "enable_scale_out": False,
    "cpu_bind": None,
    "extra_args": ["--gpu-memory-utilization", "0.15"],
    "env": {"NCCL_NVLS_ENABLE": "0"},
    "startup_timeout_s": 480.0,
}


def reward_divisible_by_4(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The demo's checkable reward: fraction of completion tokens whose id is divisible by 4."""
    return [sum(1 for t in ids if t % 4 == 0) / max(1, len(ids)) for ids in completion_ids]


def _prompts(tokenizer: Any, n: int, seed: int) -> list[str]:
    """``n`` prompts of 8 random tokens decoded to text (ids >= 259 decode to plain ASCII)."""
    rng = random.Random(seed)
    return [tokenizer.decode([rng.randrange(259, 2048) for _ in range(8)]) for _ in range(n)]


def train(p: Params, model: Path, pool: EmbeddedPool, workdir: Path) -> dict[str, Any]:
    """Run ``GRPOTrainer`` against ``pool`` (blocking; call it off the pool's event loop)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental"
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from rolloutpool.integrations.trl import PoolLink

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    dataset = Dataset.from_dict(
        {"prompt": _prompts(tokenizer, p.steps * p.prompts_per_step, p.seed)}
    )
    scored: list[tuple[int, float]] = []  # (generation, reward) of every sample TRL scored

    def divisible_by_4(completion_ids: list[list[int]], **kw: Any) -> list[float | None]:
        rewards = reward_divisible_by_4(completion_ids)
        scored.extend(zip(kw["rollout_generation"], rewards, strict=True))
        return list(rewards)

    link = PoolLink(
        pool.router_url,
        pool.updater_url,
        admin_token=pool.admin_token,
        checkpoint_dir=workdir / "ckpts",
        push_every=p.push_every,
        wait=p.wait,
        sampling={"ignore_eos": True},  # fixed-length completions, as in the demo
        # vLLM 0.26 reports no spans; its fp32 attention on GPU (Triton) may round through
        # TF32, so the probe wants wider greedy margins than fp32 CPU vs fp32 CPU
        require_spans=not p.gpu,
        probe={"margin": 0.03} if p.gpu else None,
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
        callbacks=[link.callback],
    )
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        link.close()
    train_s = time.monotonic() - t0
    return _summary(p, link, trainer.state.log_history, scored, train_s)


def _summary(
    p: Params,
    link: Any,
    history: list[dict[str, Any]],
    scored: list[tuple[int, float]],
    train_s: float,
) -> dict[str, Any]:
    by_step = [(int(h["step"]), float(h["reward"])) for h in history if "reward" in h]
    rewards = [r for _, r in by_step]
    committed = {u.generation: u for u in link.updates if u.rolled_s is not None}
    samples = link.samples
    outside = sum(
        1
        for s in samples
        if s.generation not in committed
        or committed[s.generation].label != s.label
        or committed[s.generation].identity_digest != s.identity_digest
    )
    # a replica before vLLM 0.32 reports no spans (None): the router's binding is the evidence
    bad_spans = sum(1 for s in samples if s.spans is not None and s.spans != (s.label,))
    per_gen: dict[int, dict[str, Any]] = defaultdict(lambda: {"samples": 0, "replicas": set()})
    for s in samples:
        per_gen[s.generation]["samples"] += 1
        per_gen[s.generation]["replicas"].add(s.replica)
    gen_rewards: dict[int, list[float]] = defaultdict(list)
    for g, r in scored:
        gen_rewards[g].append(r)
    training_updates = [u for u in link.updates if u.step > 0]
    lags = [float(h["pool/policy_lag_steps"]) for h in history if "pool/policy_lag_steps" in h]
    stalls = [u.stall_s for u in training_updates]
    rolled = [u.rolled_s for u in training_updates if u.rolled_s is not None]
    windows = [w for u in training_updates for w in u.windows_s.values()]
    return {
        "trl_version": importlib.metadata.version("trl"),
        "steps": len(by_step),
        "updates": len(training_updates),
        "reward_first": round(statistics.fmean(rewards[: p.window]), 4),
        "reward_last": round(statistics.fmean(rewards[-p.window :]), 4),
        "cross_generation": bad_spans + link.refused.get("provenance_violation", 0),
        "samples": len(scored),
        "samples_with_generation": (
            sum(1 for g, _ in scored if isinstance(g, int)) / len(scored) if scored else 0.0
        ),
        "samples_recorded": len(samples),
        "samples_span_checked": sum(1 for s in samples if s.spans is not None),
        "outside_committed": outside,
        "generations_sampled": sorted(per_gen),
        "refused_and_retried": dict(link.refused),
        "policy_lag_steps": {
            "mean": round(statistics.fmean(lags), 3) if lags else None,
            "max": max(lags, default=None),
        },
        "stall_s": {
            "mean": round(statistics.fmean(stalls), 3) if stalls else None,
            "max": round(max(stalls), 3) if stalls else None,
        },
        "rolled_s": {"mean": round(statistics.fmean(rolled), 3) if rolled else None},
        "update_window_s": {
            "mean": round(statistics.fmean(windows), 3) if windows else None,
            "max": round(max(windows), 3) if windows else None,
        },
        "reward_by_step": [round(r, 4) for r in rewards],
        "per_generation": {
            str(g): {
                "samples": v["samples"],
                "mean_reward": (
                    round(statistics.fmean(gen_rewards[g]), 4) if gen_rewards.get(g) else None
                ),
                "policy_step": committed[g].step if g in committed else None,
                "replicas": sorted(v["replicas"]),
            }
            for g, v in sorted(per_gen.items())
        },
        "config": asdict(p),
        "train_s": round(train_s, 1),
    }


async def scenario(runs: list[Params], workdir: Path) -> list[dict[str, Any]]:
    """Bring the embedded pool up on free ports (GPU replicas if ``runs[0].gpu``), train each of
    ``runs`` in turn through it (each one starts by pushing its fresh initial weights), tear
    everything down."""
    pool = EmbeddedPool(
        PoolConfig(
            workdir=workdir / "pool",
            fresh=True,
            model_init_std=0.02,
            router_port=0,
            updater_port=0,
            replica=GPU_REPLICA if runs[0].gpu else {},
        )
    )
    results: list[dict[str, Any]] = []
    try:
        await pool.start()
        assert pool.model is not None
        for i, p in enumerate(runs):
            results.append(await asyncio.to_thread(train, p, pool.model, pool, workdir / f"r{i}"))
    finally:
        await pool.stop()
    return results
