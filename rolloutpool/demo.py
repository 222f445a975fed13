"""``rolloutpool demo``: a tiny, real RL loop on CPU through the pool.

The task: a prompt of random tokens; the reward of a completion is the fraction of its tokens
whose id is divisible by 4 (a checkable "target token pattern"; a uniform policy scores 0.25).
The trainer is REINFORCE with a group baseline (GRPO-style advantage normalization) on the
tiny Llama, in torch on CPU. Every step draws its rollouts **through the router** (so each one
is bound to the generation that produced it); every ``push_every`` steps the trainer saves a
checkpoint, computes a validation probe from its own weights and pushes it to the updater,
which drains and hot-updates the replicas one at a time. Meanwhile a background load keeps
sending token-in/token-out rollouts (``/inference/v1/generate``, which carries vLLM's per-token
``weight_versions`` spans) and counts any rollout whose spans name more than one generation or
a generation other than its binding: ``cross_generation`` must stay 0.

Output: a table per generation, a PNG (reward by generation; replica-generation timeline) and
``demo.json``, in the results directory (in a checkout ``bench/results``:
:func:`pool.paths.default_results_dir`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import shutil
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rolloutpool.embedded import EmbeddedPool, PoolConfig
from updater.client import UpdaterClient
from updater.probe import probe_from_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class DemoConfig:
    steps: int = 30
    push_every: int = 2
    batch: int = 16
    prompt_len: int = 8
    max_tokens: int = 8
    lr: float = 1e-2
    background_concurrency: int = 2
    seed: int = 0


def reward(tokens: list[int]) -> float:
    return sum(1 for t in tokens if t % 4 == 0) / max(1, len(tokens))


@dataclass
class Stats:
    rewards: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    rollouts: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    replicas: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    windows: dict[int, float] = field(default_factory=dict)
    background: int = 0
    background_errors: int = 0
    cross_generation: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def count(self, rollout: dict[str, Any]) -> None:
        g = int(rollout["generation"])
        self.rollouts[g] += 1
        self.replicas[g].add(str(rollout["replica"]))


class Trainer:
    """The policy in torch; produces checkpoints the updater can load (same manifest)."""

    def __init__(self, base: Path, cfg: DemoConfig, workdir: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        hf_logging: Any = importlib.import_module("transformers.utils.logging")
        hf_logging.disable_progress_bar()
        torch.manual_seed(cfg.seed)
        self.torch = torch
        self.base = base
        self.cfg = cfg
        self.workdir = workdir
        self.model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)

    def step(self, prompts: list[list[int]], completions: list[list[int]]) -> float:
        torch = self.torch
        r = torch.tensor([reward(c) for c in completions])
        adv = (r - r.mean()) / (r.std() + 1e-6)
        seqs = torch.tensor([p + c for p, c in zip(prompts, completions, strict=True)])
        comp = seqs[:, len(prompts[0]) :]
        logits = self.model(seqs).logits[:, len(prompts[0]) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1).sum(1)
        loss = -(adv * logp).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(r.mean())

    def checkpoint(self, step: int) -> tuple[Path, tuple[list[int], list[int]]]:
        out = self.workdir / f"step-{step:04d}"
        if out.exists():
            shutil.rmtree(out)
        self.model.save_pretrained(str(out))
        for name in TOKENIZER_FILES:
            if (self.base / name).exists():
                shutil.copy2(self.base / name, out / name)
        probe = probe_from_model(self.model, n_tokens=4, margin=2e-3, tries=512, seed=step)
        self.model.train()
        return out, probe


async def _rollout(http: httpx.AsyncClient, prompt: list[int], cfg: DemoConfig) -> dict[str, Any]:
    body = {
        "model": "rolloutpool",
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 1.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    r = await http.post("/v1/completions", json=body)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


async def _background(http: httpx.AsyncClient, stats: Stats, stop: asyncio.Event) -> None:
    rng = random.Random(1)
    while not stop.is_set():
        body = {
            "model": "rolloutpool",
            "token_ids": [rng.randrange(3, 2048) for _ in range(12)],
            "sampling_params": {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True},
        }
        try:
            r = await http.post("/inference/v1/generate", json=body)
        except httpx.HTTPError:
            stats.background_errors += 1
            continue
        data = r.json()
        if r.status_code == 502 and data.get("error", {}).get("code") == "provenance_violation":
            stats.cross_generation += 1
            continue
        if r.status_code != 200:
            stats.background_errors += 1
            await asyncio.sleep(0.1)
            continue
        ro = data["rollout"]
        spans = data["choices"][0].get("weight_versions") or []
        if len(spans) != 1 or spans[0]["version"] != ro["label"]:
            stats.cross_generation += 1
        stats.background += 1
        stats.count(ro)


async def _timeline(http: httpx.AsyncClient, stats: Stats, stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        try:
            pool = (await http.get("/v1/pool")).json()
            stats.timeline.append(
                {
                    "t": round(time.monotonic() - t0, 3),
                    "replicas": {
                        r["replica_id"]: [r["state"], r["generation"]] for r in pool["replicas"]
                    },
                }
            )
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.25)


async def train(pool: EmbeddedPool, cfg: DemoConfig, workdir: Path) -> tuple[Stats, list[Any]]:
    assert pool.model is not None
    trainer = await asyncio.to_thread(Trainer, pool.model, cfg, workdir / "ckpts")
    stats = Stats()
    rng = random.Random(cfg.seed)
    stop = asyncio.Event()
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=pool.router_url, timeout=120, limits=limits) as http:
        bg = [
            asyncio.create_task(_background(http, stats, stop))
            for _ in range(cfg.background_concurrency)
        ]
        tl = asyncio.create_task(_timeline(http, stats, stop, t0))
        updates: list[Any] = []
        client = UpdaterClient(pool.updater_url, pool.admin_token)
        try:
            for step in range(1, cfg.steps + 1):
                prompts = [
                    [rng.randrange(3, 2048) for _ in range(cfg.prompt_len)]
                    for _ in range(cfg.batch)
                ]
                results = await asyncio.gather(*(_rollout(http, p, cfg) for p in prompts))
                completions = [r["choices"][0]["token_ids"] for r in results]
                for res, comp in zip(results, completions, strict=True):
                    g = int(res["rollout"]["generation"])
                    stats.rewards[g].append(reward(comp))
                    stats.count(res["rollout"])
                mean_r = await asyncio.to_thread(trainer.step, prompts, completions)
                gens = sorted({int(r["rollout"]["generation"]) for r in results})
                print(f"  step {step:>3}  reward {mean_r:.3f}  rollouts from g{gens}", flush=True)
                if step % cfg.push_every == 0 and step < cfg.steps:
                    ckpt, probe = await asyncio.to_thread(trainer.checkpoint, step)
                    rec = await asyncio.to_thread(
                        client.push, ckpt, step=step, probe=probe, trainer_run="demo"
                    )
                    done = await asyncio.to_thread(client.wait, rec["id"], 300.0)
                    windows = [
                        r["window_s"]
                        for r in done["replicas"].values()
                        if r.get("window_s") is not None
                    ]
                    stats.windows[done["generation"]] = max(windows, default=0.0)
                    updates.append(done)
                    print(
                        f"  pushed step {step} -> g{done['generation']} "
                        f"(window {stats.windows[done['generation']]:.2f}s per replica)",
                        flush=True,
                    )
        finally:
            stop.set()
            client.close()
            await asyncio.gather(*bg, tl, return_exceptions=True)
    return stats, updates


def table(stats: Stats) -> str:
    lines = [f"{'gen':>4} {'rollouts':>9} {'mean reward':>12} {'replicas':>22} {'window s':>9}"]
    for g in sorted(stats.rollouts):
        rs = stats.rewards.get(g, [])
        mean = f"{statistics.fmean(rs):.3f}" if rs else "-"
        win = f"{stats.windows[g]:.2f}" if g in stats.windows else "-"
        lines.append(
            f"{g:>4} {stats.rollouts[g]:>9} {mean:>12} "
            f"{','.join(sorted(stats.replicas[g])):>22} {win:>9}"
        )
    return "\n".join(lines)


def plot(stats: Stats, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6.5))
    gens = sorted(g for g in stats.rewards if stats.rewards[g])
    a.plot(gens, [statistics.fmean(stats.rewards[g]) for g in gens], "o-")
    a.set_xlabel("policy generation")
    a.set_ylabel("mean reward (training rollouts)")
    a.set_title("RolloutPool demo: reward by generation")
    a.grid(alpha=0.3)
    ids = sorted({r for s in stats.timeline for r in s["replicas"]})
    for i, rid in enumerate(ids):
        ts = [s["t"] for s in stats.timeline if rid in s["replicas"]]
        gs = [s["replicas"][rid][1] for s in stats.timeline if rid in s["replicas"]]
        b.step(ts, [(-1 if g is None else g) + 0.08 * i for g in gs], where="post", label=rid)
        down = [
            t
            for s, t in zip(stats.timeline, ts, strict=False)
            if rid in s["replicas"] and s["replicas"][rid][0] != "READY"
        ]
        b.plot(down, [0.0 + 0.08 * i - 0.5] * len(down), "|", ms=6)
    b.set_xlabel("seconds")
    b.set_ylabel("generation served")
    b.set_title("replica-generation timeline (ticks below: replica not READY)")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


async def run(cfg: DemoConfig, pool_config: PoolConfig, results: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    pool = EmbeddedPool(pool_config)
    try:
        await pool.start()
        print(f"training {cfg.steps} steps, pushing every {cfg.push_every} steps", flush=True)
        stats, updates = await train(pool, cfg, pool_config.workdir)
    finally:
        await pool.stop()
    print(table(stats))
    gens = sorted(g for g in stats.rewards if stats.rewards[g])
    result: dict[str, Any] = {
        "generations": len(stats.rollouts),
        "reward_first": round(statistics.fmean(stats.rewards[gens[0]]), 4),
        "reward_last": round(statistics.fmean(stats.rewards[gens[-1]]), 4),
        "cross_generation": stats.cross_generation,
        "rollouts": sum(stats.rollouts.values()),
        "background_rollouts": stats.background,
        "background_errors": stats.background_errors,
        "updates": len(updates),
        "per_generation": {
            str(g): {
                "rollouts": stats.rollouts[g],
                "mean_reward": (
                    round(statistics.fmean(stats.rewards[g]), 4) if stats.rewards.get(g) else None
                ),
                "replicas": sorted(stats.replicas[g]),
                "update_window_s": stats.windows.get(g),
            }
            for g in sorted(stats.rollouts)
        },
        "config": cfg.__dict__,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    png = results / "demo.png"
    await asyncio.to_thread(plot, stats, png)
    print(f"plot: {png}")
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "generations",
                    "reward_first",
                    "reward_last",
                    "cross_generation",
                    "rollouts",
                )
            }
        )
    )
    return result
