"""Train a policy with TRL's ``GRPOTrainer`` (unmodified) through a running RolloutPool.

    .venv/bin/pip install -e '.[cpu,trl]'
    .venv/bin/rolloutpool up                      # terminal 1: prints the admin token
    .venv/bin/python examples/trl_grpo.py --token TOKEN          # terminal 2
    # http://127.0.0.1:8000/dashboard: the generations rolling over the replicas

Every completion comes from the pool's router, bound to one committed generation; every
``--push-every`` steps the trainer's checkpoint goes to the updater, which rolls it over the
replicas one at a time while the others keep serving. Each step prints TRL's mean reward, the
generations its samples came from and how many trainer steps behind their policy was.

The task is the demo's: prompts of random text; the reward of a completion is the fraction of its
tokens whose id is divisible by 4 (a uniform policy scores 0.25, the reward climbs towards 1.0
within ~20 steps). The default model is the tiny model ``rolloutpool up`` serves, built with a
smaller init (a near-uniform policy, room to learn); the first thing the trainer does is push it,
so the pool serves exactly the trainer's weights. Use ``--model`` for another checkpoint with the
same architecture as the pool's model. Checkpoints are written under ``--checkpoints``, which the
updater must be able to read (the same machine for ``rolloutpool up``). With GPU replicas of
vLLM 0.26 (``rolloutpool up --config`` with ``replica: {flavor: gpu, ...}``,
docs/guides/trainers.md), add ``--no-spans --probe-margin 0.03``: that vLLM reports no
per-token weight versions to check, and its fp32 attention may round through TF32.

For your own task: replace ``prompts()`` with your dataset and ``divisible_by_4`` with your reward
function (it also receives ``rollout_generation`` and ``rollout_policy_step`` per sample).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL calls rollout_func "experimental"

from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from rolloutpool.integrations.trl import PoolLink


def divisible_by_4(completion_ids: list[list[int]], **_: Any) -> list[float | None]:
    """Reward: fraction of completion tokens whose id is divisible by 4."""
    return [sum(1 for t in ids if t % 4 == 0) / max(1, len(ids)) for ids in completion_ids]


def prompts(tokenizer: Any, n: int) -> list[str]:
    """``n`` prompts of 8 random tokens, as text."""
    rng = random.Random(0)
    return [tokenizer.decode([rng.randrange(259, 2048) for _ in range(8)]) for _ in range(n)]


class Progress(TrainerCallback):
    """One line per step: reward, generations sampled, policy lag."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if state.is_world_process_zero and logs and "reward" in logs:
            print(
                f"step {state.global_step:>4}  reward {logs['reward']:.3f}  "
                f"generation {logs.get('pool/generation', float('nan')):.1f}  "
                f"policy lag {logs.get('pool/policy_lag_steps', float('nan')):.1f} steps",
                flush=True,
            )


def main() -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default=env("ROLLOUTPOOL_ROUTER", "http://127.0.0.1:8000"))
    ap.add_argument("--updater", default=env("ROLLOUTPOOL_UPDATER", "http://127.0.0.1:8300"))
    ap.add_argument("--token", default=env("ROLLOUTPOOL_ADMIN_TOKEN"), help="updater admin token")
    ap.add_argument("--api-key", default=env("ROLLOUTPOOL_API_KEY"), help="router API key")
    ap.add_argument("--model", type=Path, help="default: the tiny model, near-uniform init")
    ap.add_argument("--checkpoints", type=Path, default=Path("trl-checkpoints"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--push-every", type=int, default=2)
    ap.add_argument("--no-wait", action="store_true", help="keep training while updates roll")
    ap.add_argument("--report-to", default="none", help="e.g. tensorboard, trackio, wandb")
    ap.add_argument(
        "--no-spans",
        action="store_true",
        help="replicas before vLLM 0.32 (e.g. 0.26 GPUs): no weight_versions to check",
    )
    ap.add_argument(
        "--probe-margin",
        type=float,
        default=2e-3,
        help="greedy margin of the validation probe (GPU replicas: 0.03; their fp32 attention "
        "may round through TF32)",
    )
    args = ap.parse_args()

    if args.model is None:
        from rolloutpool.local.models import ensure_model

        args.model = ensure_model("random", seed=1, init_std=0.02)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    link = PoolLink(
        args.router,
        args.updater,
        admin_token=args.token,
        api_key=args.api_key,
        checkpoint_dir=args.checkpoints.resolve(),
        push_every=args.push_every,
        wait=not args.no_wait,
        sampling={"ignore_eos": True},
        require_spans=not args.no_spans,
        probe={"margin": args.probe_margin},
    )
    config = GRPOConfig(
        output_dir=str(args.checkpoints.resolve() / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions per step
        num_generations=8,
        max_completion_length=8,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=args.report_to,
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(args.model),
        reward_funcs=link.reward(divisible_by_4),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts(tokenizer, 4 * args.steps)}),
        processing_class=tokenizer,
        rollout_func=link.rollout_func,
        callbacks=[link.callback, Progress()],
    )
    trainer.remove_callback(PrinterCallback)  # Progress prints the lines that matter here
    try:
        trainer.train()
    finally:
        link.close()
    stalls = [u.stall_s for u in link.updates[1:]]
    print(
        f"{len(link.samples)} samples from generations "
        f"{sorted({s.generation for s in link.samples})}; {len(stalls)} updates, "
        f"mean trainer stall {sum(stalls) / max(1, len(stalls)):.2f}s per update"
    )


if __name__ == "__main__":
    main()
