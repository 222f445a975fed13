"""The GPU benchmarks' shared harness: the environment (Redis store, lease, replicas as
:class:`~pool.launcher.LocalReplica` processes of vLLM 0.26 on the GPU host), the trainer that
owns each generation's weights, the teacher-forced log-prob check, rollout load and its
verification. Used by ``bench.gpu_update``, ``bench.gpu_direct``, ``bench.gpu_waves``,
``bench.gpu_ipc`` and ``bench.gpu_trl``; runs on the GPU host only (``tests/gpu/README.md``).

**Validation.** Greedy exact match is useless for random bf16 weights (near-ties flip), so the
benchmarks validate with a teacher-forced log-prob check (:func:`tf_check`): vLLM's
``prompt_logprobs`` of fixed 64-token sequences against the trainer's own log-probs for the
target generation; pass = mean |diff| <= ``TF_MEAN_TOL`` and max |diff| <= ``TF_MAX_TOL``.
Rollouts are checked the same way on their sampled tokens (:func:`verify_rollouts`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pool.errors import AdmissionRefused
from pool.types import (
    BindingState,
    Generation,
    Manifest,
    ReplicaState,
    WeightIdentity,
)
from updater.transports.nccl import CheckpointSource, SourceSpec

S = ReplicaState
GIB = 1024**3
MIB = 1024**2
TF_MEAN_TOL = 0.10  # nats, mean |vLLM - trainer| over a sequence
TF_MAX_TOL = 0.75  # nats, any single position
ROLLOUT_MEAN_TOL = 0.15
SERVED = "test"
PROMPT_LEN, GEN_LEN = 32, 48  # rollouts of the load
RESULTS = Path(__file__).resolve().parent.parent / "results"  # bench/results


def now() -> float:
    return time.monotonic()


# ------------------------------------------------------------------------------ sources


class StallingCheckpointSource(CheckpointSource):
    """Fault injection for phase ``d``: a checkpoint source that stops after ``stall_after``
    tensors (mid-broadcast: earlier chunks are already on the wire), writes ``flag`` and then
    sleeps until its process is killed. Built inside the sending child from its spec."""

    def __init__(self, path: str, device: str, stall_after: int, flag: str) -> None:
        super().__init__(path, device)
        self.stall_after = stall_after
        self.flag = flag

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(super().__iter__()):
            if i == self.stall_after:
                Path(self.flag).write_text(f"{os.getpid()} {time.time()}\n")
                while True:
                    time.sleep(1.0)
            yield item

    def spec(self) -> SourceSpec | None:
        return SourceSpec(
            f"{__name__}:StallingCheckpointSource",
            (
                ("path", str(self.path)),
                ("device", self.device),
                ("stall_after", self.stall_after),
                ("flag", self.flag),
            ),
        )


# ------------------------------------------------------------------------------ the trainer


class Trainer:
    """A Hugging Face model of the replica's architecture on GPU 0, with deterministic weights
    per generation, and teacher-forced log-probs."""

    def __init__(self, model_dir: Path, device: str = "cuda:0", dtype: str = "bfloat16") -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        if self.cuda:
            torch.cuda.set_device(torch.device(device))
        self.cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                self.cfg, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.generation: int | None = None
        self.vocab_limit = min(30000, int(self.cfg.vocab_size))
        rng = random.Random(7)
        self.ref_seqs = [
            [rng.randrange(100, self.vocab_limit) for _ in range(64)] for _ in range(2)
        ]
        self._refs: dict[int, list[list[float]]] = {}

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def manifest(self) -> Manifest:
        from updater.transports.nccl import ModuleSource

        return ModuleSource(self.model).manifest()

    def set_generation(self, g: int) -> float:
        """Overwrite every weight matrix with generation ``g``'s (seeded); returns seconds."""
        torch = self.torch
        t0 = now()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(1000 + g)
        std = float(getattr(self.cfg, "initializer_range", 0.02))
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std, generator=gen)
        if self.cuda:
            torch.cuda.synchronize()
        self.generation = g
        return now() - t0

    def teacher_forced(self, seqs: list[list[int]], start: int = 1) -> list[list[float]]:
        """log p(seq[i] | seq[:i]) for i >= start, per sequence (equal lengths, batched)."""
        torch = self.torch
        out: list[list[float]] = []
        with torch.no_grad():
            for i in range(0, len(seqs), 16):
                ids = torch.tensor(seqs[i : i + 16], device=self.device)
                logits = self.model(input_ids=ids).logits.float()
                lp = torch.log_softmax(logits, dim=-1)
                tgt = ids[:, 1:]
                got = lp[:, :-1].gather(2, tgt[..., None])[..., 0][:, start - 1 :]
                out += got.tolist()
        return out

    def refs(self) -> list[list[float]]:
        assert self.generation is not None
        g = self.generation
        if g not in self._refs:
            self._refs[g] = self.teacher_forced(self.ref_seqs)
        return self._refs[g]


def diff_stats(a: list[float], b: list[float]) -> dict[str, float]:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    bad = [x for x in d if math.isnan(x)]
    d = [x for x in d if not math.isnan(x)]
    return {
        "mean": sum(d) / len(d) if d else math.inf,
        "max": max(d) if d else math.inf,
        "nan": len(bad),
    }


async def vllm_prompt_logprobs(
    client: httpx.AsyncClient, url: str, ids: list[int], salt: str
) -> list[float]:
    r = await client.post(
        f"{url}/v1/completions",
        json={
            "model": SERVED,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "cache_salt": salt,
        },
        timeout=60.0,
    )
    r.raise_for_status()
    pl = r.json()["choices"][0]["prompt_logprobs"]
    out = []
    for i in range(1, len(ids)):
        e = (pl[i] or {}).get(str(ids[i]))
        out.append(float(e["logprob"]) if e else math.nan)
    return out


async def tf_check(trainer: Trainer, url: str, salt: str) -> dict[str, Any]:
    """Teacher-forced comparison of the replica at ``url`` with the trainer's current weights."""
    refs = await asyncio.to_thread(trainer.refs)
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as c:
        got = [await vllm_prompt_logprobs(c, url, s, salt) for s in trainer.ref_seqs]
    stats = [diff_stats(r, v) for r, v in zip(refs, got, strict=True)]
    mean = max(s["mean"] for s in stats)
    mx = max(s["max"] for s in stats)
    ok = all(s["nan"] == 0 for s in stats) and mean <= TF_MEAN_TOL and mx <= TF_MAX_TOL
    return {
        "ok": ok,
        "generation": trainer.generation,
        "mean_abs": round(mean, 4),
        "max_abs": round(mx, 4),
    }


# ------------------------------------------------------------------------------ environment


@dataclass
class Env:
    args: argparse.Namespace
    result: dict[str, Any]
    work: Path
    trainer: Trainer | None = None
    redis: Any = None
    store: Any = None
    lease: Any = None
    keep: asyncio.Task[None] | None = None
    replicas: dict[str, Any] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)
    manifest: Manifest | None = None

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in self.result.items() if not k.startswith("_")}
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")


def identity(env: Env, g: int, uri: str | None = None) -> WeightIdentity:
    assert env.manifest is not None
    return WeightIdentity(
        manifest_digest=env.manifest.digest,
        checkpoint_uri=uri or f"trainer://gpu-bench/g{g}",
        step=g,
    )


def gen(g: int) -> Generation:
    return Generation(number=g, label=f"g{g}")


def target(env: Env, g: int, path: Path | None = None) -> Any:
    from updater.cycle import Probe, UpdateTarget

    p = path or Path(f"/in-process/g{g}")
    return UpdateTarget(
        gen(g), identity(env, g, str(path) if path else None), p, Probe((1, 2, 3), (1,))
    )


def replica_spec(env: Env, rid: str) -> Any:
    from pool.launcher import ReplicaSpec, free_port

    a = env.args
    cache = env.work / "compile-cache"
    extra = ["--load-format", "dummy", "--gpu-memory-utilization", str(a.gpu_util), "--seed", "0"]
    if getattr(a, "extension", False):  # RolloutPool's worker extension (nccl_direct, checksums)
        extra += ["--worker-extension-cls", "pool.replica_extension.WeightExtension"]
    return ReplicaSpec(
        model=Path(a.model),
        flavor="gpu",
        port=free_port(),
        name=f"gpu-{rid}",
        served_model_name=SERVED,
        cuda_visible_devices=a.replica_gpu,
        kv_cache_bytes=None,
        enforce_eager=a.enforce_eager,
        dtype="bfloat16",
        max_model_len=a.max_model_len,
        weight_transfer_backend="nccl",
        extra_args=tuple(extra),
        env={
            "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "NCCL_NVLS_ENABLE": "0",
        },
        work_dir=env.work / rid,
        startup_timeout_s=480,
        stop_grace_s=10,
    )


async def start_replica(env: Env, rid: str) -> float:
    from pool.engine import VllmEngine
    from pool.launcher import LocalReplica
    from updater.cycle import ReplicaHandle

    rep = LocalReplica(replica_spec(env, rid))
    env.replicas[rid] = rep
    took = await rep.start()
    engine = VllmEngine(rep.url, timeout=60.0)
    await engine.bootstrap()
    assert env.manifest is not None
    env.handles[rid] = ReplicaHandle(rid, engine, env.manifest)
    await env.store.register_replica(rid, rep.url, env.lease.require())
    print(
        f"[{rid}] serving at {rep.url} after {took:.1f}s (vLLM {engine.capabilities.version})",
        flush=True,
    )
    return took


async def record_pids(env: Env) -> None:
    """Keep ``<work>/pids.txt`` listing the replicas' process groups, so a later run on the same
    machine can end leftovers of a killed run by id (``kill -- -PID``)."""
    path = env.work / "pids.txt"
    seen: set[int] = set()
    while True:
        pids = {rep.pid for rep in env.replicas.values() if rep.pid is not None}
        if pids - seen:
            seen |= pids
            path.write_text("".join(f"{p}\n" for p in sorted(seen)))
        await asyncio.sleep(0.5)


async def start_pool(env: Env) -> None:
    from pool.settings import StoreSettings
    from pool.store import RedisStore
    from testkit.redis_server import RedisServer

    env.redis = RedisServer(env.work / "redis").start()
    env.store = RedisStore.connect(
        StoreSettings(url=env.redis.url, namespace=f"gpu{int(time.time())}")
    )
    env.lease = env.store.updater_lease("gpu-bench")
    await env.lease.acquire()
    env.keep = asyncio.create_task(env.lease.keep_alive())


async def build_trainer(env: Env) -> None:
    t0 = now()
    env.trainer = await asyncio.to_thread(Trainer, Path(env.args.model))
    env.manifest = await asyncio.to_thread(env.trainer.manifest)
    env.result["bytes"] = env.trainer.nbytes()
    env.result["tensors"] = len(env.manifest.tensors)
    env.result.setdefault("timings", {})["trainer_build_s"] = round(now() - t0, 2)
    print(
        f"trainer: {len(env.manifest.tensors)} tensors, {env.trainer.nbytes() / 1e9:.2f} GB "
        f"in {now() - t0:.1f}s",
        flush=True,
    )


async def start_replicas_with_trainer(env: Env, rids: list[str]) -> dict[str, float]:
    """Start the first replica while the trainer is built (GPU 0 vs GPU 1), then the rest one
    after the other (vLLM's start-up memory profiling assumes nobody else allocates)."""
    starts: dict[str, float] = {}
    build = asyncio.create_task(build_trainer(env))
    # the manifest is needed for the handle: start the process, register after the build
    first = rids[0]
    from pool.launcher import LocalReplica

    rep = LocalReplica(replica_spec(env, first))
    env.replicas[first] = rep
    starts[first] = await rep.start()
    await build
    await attach(env, first)
    print(f"[{first}] serving after {starts[first]:.1f}s", flush=True)
    for rid in rids[1:]:
        starts[rid] = await start_replica(env, rid)
    return starts


async def attach(env: Env, rid: str) -> None:
    from pool.engine import VllmEngine
    from updater.cycle import ReplicaHandle

    rep = env.replicas[rid]
    engine = VllmEngine(rep.url, timeout=60.0)
    await engine.bootstrap()
    assert env.manifest is not None
    env.handles[rid] = ReplicaHandle(rid, engine, env.manifest)
    await env.store.register_replica(rid, rep.url, env.lease.require())


async def shutdown(env: Env) -> None:
    for rep in env.replicas.values():
        with contextlib.suppress(Exception):
            await rep.stop(grace_s=5)
    if env.keep is not None:
        env.keep.cancel()
    with contextlib.suppress(Exception):
        await env.lease.release()
    with contextlib.suppress(Exception):
        await env.store.close()
    if env.redis is not None:
        with contextlib.suppress(Exception):
            env.redis.stop()


def nccl_config(env: Env, **kw: Any) -> Any:
    from updater.transports.nccl import NcclConfig, Packing

    a = env.args
    kw.setdefault("master_port", a.nccl_port)
    return NcclConfig(
        master_address="127.0.0.1",
        packing=Packing(packed=True, buffer_bytes=a.buffer_mb * MIB, num_buffers=a.num_buffers),
        **kw,
    )


# ------------------------------------------------------------------------------ load


@dataclass
class Load:
    env: Env
    rids: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, workers: int) -> None:
        for w in range(workers):
            self.tasks.append(asyncio.create_task(self._worker(w)))

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _worker(self, wid: int) -> None:
        env = self.env
        rng = random.Random(wid * 7919 + len(self.records))
        async with httpx.AsyncClient(
            limits=httpx.Limits(max_keepalive_connections=0), timeout=180.0
        ) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                rid = f"w{wid}-{i}-{rng.randrange(1 << 30)}"
                adm = None
                order = self.rids[i % len(self.rids) :] + self.rids[: i % len(self.rids)]
                for cand in order:
                    try:
                        adm = await env.store.admit(rid, cand, max_staleness=1)
                        break
                    except AdmissionRefused:
                        continue
                    except Exception as e:  # store gone (shutdown): stop quietly
                        self.errors.append(f"admit: {type(e).__name__}: {e}")
                        return
                if adm is None:
                    self.refused += 1
                    await asyncio.sleep(0.05)
                    continue
                assert env.trainer is not None
                prompt = [rng.randrange(100, env.trainer.vocab_limit) for _ in range(PROMPT_LEN)]
                url = env.replicas[adm.replica_id].url
                t0 = time.time()
                try:
                    r = await client.post(
                        f"{url}/v1/completions",
                        json={
                            "model": SERVED,
                            "prompt": prompt,
                            "max_tokens": GEN_LEN,
                            "temperature": 1.0,
                            "logprobs": 1,
                            "ignore_eos": True,
                            "return_tokens_as_token_ids": True,
                            "cache_salt": adm.label,
                            "seed": rng.randrange(1 << 30),
                        },
                    )
                    r.raise_for_status()
                    ch = r.json()["choices"][0]
                    lp = ch["logprobs"]
                    toks = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
                    lps = [float(x) for x in lp["token_logprobs"]]
                    await env.store.release(rid, adm.replica_id, completion_tokens=len(toks))
                    self.records.append(
                        {
                            "rollout": rid,
                            "replica": adm.replica_id,
                            "generation": adm.generation,
                            "prompt": prompt,
                            "tokens": toks,
                            "logprobs": lps,
                            "t0": t0,
                            "t1": time.time(),
                        }
                    )
                except Exception as e:
                    self.errors.append(f"{rid}@{adm.replica_id}: {type(e).__name__}: {e}")
                    with contextlib.suppress(Exception):
                        await env.store.release(
                            rid, adm.replica_id, BindingState.ABORTED, reason="error"
                        )


async def verify_rollouts(
    env: Env, records: list[dict[str, Any]], generations: list[int]
) -> dict[str, Any]:
    """Teacher-force every rollout under every generation; each must match its bound one."""
    trainer = env.trainer
    assert trainer is not None
    keep = trainer.generation
    seqs = [r["prompt"] + r["tokens"] for r in records]
    means: dict[int, list[float]] = {}
    for g in generations:
        await asyncio.to_thread(trainer.set_generation, g)
        tf = await asyncio.to_thread(trainer.teacher_forced, seqs, PROMPT_LEN)
        means[g] = [diff_stats(t, r["logprobs"])["mean"] for t, r in zip(tf, records, strict=True)]
    if keep is not None:
        await asyncio.to_thread(trainer.set_generation, keep)
    cross, worst = 0, 0.0
    by_gen: dict[int, int] = {}
    other_min = math.inf
    bad: list[dict[str, Any]] = []
    for i, r in enumerate(records):
        g = r["generation"]
        by_gen[g] = by_gen.get(g, 0) + 1
        own = means[g][i]
        best = min(generations, key=lambda x: means[x][i])
        others = [means[x][i] for x in generations if x != g]
        if others:
            other_min = min(other_min, min(others))
        worst = max(worst, own)
        if best != g or own > ROLLOUT_MEAN_TOL:
            cross += 1
            if len(bad) < 5:
                bad.append(
                    {
                        "rollout": r["rollout"],
                        "bound": g,
                        "best": best,
                        "means": {x: round(means[x][i], 3) for x in generations},
                    }
                )
    return {
        "rollouts": len(records),
        "by_generation": by_gen,
        "cross_generation": cross,
        "worst_own_mean_abs": round(worst, 4),
        "closest_other_generation_mean_abs": round(other_min, 4),
        "examples_bad": bad,
    }


def save_checkpoint(trainer: Trainer, fallback: Path) -> tuple[Path, float]:
    """Write the trainer's current weights as a safetensors checkpoint (RAM disk if it fits)."""
    from safetensors.torch import save_file

    t0 = now()
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    root = Path("/dev/shm") if shm_free > 40 * GIB else fallback
    path = root / f"ckpt-g{trainer.generation}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    tensors = {n: p.detach().contiguous() for n, p in trainer.model.named_parameters()}
    save_file(tensors, str(path / "model.safetensors"))
    return path, now() - t0


# ------------------------------------------------------------------------------ main


def gpu_info() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.split("\n")
        names = [n.strip() for n in out if n.strip()]
        return f"{len(names)}x {names[0]}" if names else "unknown"
    except Exception:
        return "unknown"


def phase_raw(env: Env) -> None:
    script = Path(env.args.nccl_bw)
    if not script.is_file():
        env.result["raw_nccl"] = {"error": f"{script} not found"}
        return
    port = str(env.args.nccl_port + 40)
    procs = []
    for rank, gpu in ((0, "0"), (1, env.args.replica_gpu)):
        e = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, NCCL_NVLS_ENABLE="0")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(rank), port],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    sizes = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"BW broadcast (\d+) MiB: [\d.]+ ms\s+([\d.]+) GB/s", outs[0])
    }
    env.result["raw_nccl"] = {"by_MiB": sizes, "log_tail": outs[0][-600:] if not sizes else ""}
    if sizes:
        env.result["raw_nccl_GBps"] = max(sizes.values())
    print(f"raw NCCL: {sizes}", flush=True)
