"""One replica's update cycle in the GPU benchmarks: a :class:`~updater.cycle.CycleRunner`
whose validator is the teacher-forced log-prob check against the target generation's reference
(:class:`Refs`, taken while the trainer held that generation), and the per-cycle row the
benchmarks record. Used by ``bench.gpu_direct``, ``bench.gpu_waves`` and ``bench.gpu_ipc``."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx

from bench.gpu.harness import SERVED, TF_MAX_TOL, TF_MEAN_TOL, Env, Trainer, diff_stats, target
from pool.evidence import LabelEvidence, ValidationEvidence
from pool.types import Generation


def now() -> float:
    return time.monotonic()


class Refs:
    """Reference log-probs per generation, computed while the trainer held that generation's
    weights (so a validator can check a replica against generation g after the trainer moved
    on). One keep-alive client for every check."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.by_gen: dict[int, list[list[float]]] = {}
        self.client = httpx.AsyncClient(timeout=60.0)
        self.checks: list[dict[str, Any]] = []
        self.mean_tol, self.max_tol = TF_MEAN_TOL, TF_MAX_TOL

    def take(self) -> None:
        g = self.trainer.generation
        assert g is not None
        self.by_gen[g] = self.trainer.refs()

    async def check(self, url: str, g: int, salt: str) -> dict[str, Any]:
        refs = self.by_gen[g]
        got = await prompt_logprobs_batch(self.client, url, self.trainer.ref_seqs, salt)
        stats = [diff_stats(r, v) for r, v in zip(refs, got, strict=True)]
        mean = max(s["mean"] for s in stats)
        mx = max(s["max"] for s in stats)
        ok = all(s["nan"] == 0 for s in stats) and mean <= self.mean_tol and mx <= self.max_tol
        return {"ok": ok, "generation": g, "mean_abs": round(mean, 4), "max_abs": round(mx, 4)}


async def prompt_logprobs_batch(
    client: httpx.AsyncClient, url: str, seqs: list[list[int]], salt: str
) -> list[list[float]]:
    """vLLM's prompt log-probs of each sequence's own tokens, all sequences in one request."""
    r = await client.post(
        f"{url}/v1/completions",
        json={
            "model": SERVED,
            "prompt": seqs,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "cache_salt": salt,
        },
    )
    r.raise_for_status()
    out: list[list[float]] = [[] for _ in seqs]
    for choice in r.json()["choices"]:
        ids, pl = seqs[choice["index"]], choice["prompt_logprobs"]
        for i in range(1, len(ids)):
            e = (pl[i] or {}).get(str(ids[i]))
            out[choice["index"]].append(float(e["logprob"]) if e else math.nan)
    return out


def make_runner(env: Env, transport: Any, refs: Refs, transfer_s: float = 60.0) -> Any:
    """A CycleRunner whose validator is the teacher-forced check against the target
    generation's references (checksums, where the transfer offers them, come first)."""
    from updater.cycle import CycleRunner, Deadlines

    async def teacher_forced(h: Any, g: Generation, probe: Any) -> ValidationEvidence:
        await h.engine.resume()
        res = await refs.check(h.engine.url, g.number, g.label)
        res["replica"] = h.replica_id
        refs.checks.append(res)
        ok = (1,) if res["ok"] else (0,)
        return ValidationEvidence(g, LabelEvidence(False, None), (1,), ok, detail=json.dumps(res))

    return CycleRunner(
        env.store,
        env.lease,
        transport,
        deadlines=Deadlines(transfer_s=transfer_s, preflight_s=120, validate_s=60),
        validator=teacher_forced,
    )


def cycle_row(report: Any, transport: Any, url: str, wall: float) -> dict[str, Any]:
    last = {k: v for k, v in transport.last.get(url, {}).items() if k != "chunks"}
    return {
        "outcome": report.outcome,
        "window_s": report.window_s,
        "phases": report.model_dump(mode="json")["phases"],
        "transfer": last,
        "wall_s": round(wall, 4),
    }


async def run_cycle(env: Env, runner: Any, transport: Any, rid: str, g: int) -> dict[str, Any]:
    from updater.cycle import CycleError

    h = env.handles[rid]
    t0 = now()
    try:
        rep = await runner.run(h, target(env, g))
    except CycleError as e:
        return {"outcome": e.report.outcome, "reason": e.report.reason, "generation": g}
    row = cycle_row(rep, transport, h.engine.url, now() - t0)
    row["generation"] = g
    return row


def new_generation(env: Env, refs: Refs, g: int) -> None:
    assert env.trainer is not None
    env.trainer.set_generation(g)
    refs.take()
