"""The NCCL transport on real ``vllm serve`` GPU replicas: proof and measurements (2x H200).

Runs on the GPU host (see ``tests/gpu/README.md``), never in CI. Trainer on GPU 0 (the harness
process, ``CUDA_VISIBLE_DEVICES=0``), replicas on GPU 1 (``--gpu-memory-utilization 0.4`` each,
started one after the other), model ``qwen3-8b-shape`` (Qwen3-8B shapes, 16.4 GB bf16):
replicas start with ``--load-format dummy``; the trainer builds the same architecture from the
config and gives generation ``g`` deterministic random weights (seed ``1000 + g``).

Everything goes through the project's code: :class:`~updater.cycle.CycleRunner` (real Redis
store, fenced transitions, watchdog deadlines) driving :class:`~updater.transports.nccl.
NcclTransport`; replicas are :class:`~pool.launcher.LocalReplica` processes.

**Validation.** Greedy exact match is useless for random bf16 weights (near-ties flip), so the
cycle runner's greedy probe is replaced here by a teacher-forced log-prob check
(:func:`make_runner` gives the :class:`~updater.cycle.CycleRunner` that validator): vLLM's
``prompt_logprobs`` of two fixed 64-token sequences against the trainer's own log-probs for the
target generation; pass = mean |diff| <= ``TF_MEAN_TOL`` and max |diff| <= ``TF_MAX_TOL``.
Rollouts are checked the same way on their sampled tokens (vLLM's raw sampled-token log-probs vs
the trainer's, for every generation): ``cross_generation`` counts rollouts whose closest
generation is not the one the store bound them to (or that match none).

Phases (``--phases``, one or more, in this order):

* ``raw``: raw NCCL broadcast GPU0 -> GPU1 with vLLM's communicator, before any server starts:
  the ceiling. The script is not in this repository: it is ``../shared/gpu/nccl_bw.py``, which
  the GPU bundle stages as ``/tmp/stage/nccl_bw.py`` (``--nccl-bw``); without it the phase
  records an error and the others run.
* ``a``: one replica, cold start; bootstrap to g0 (NCCL), one full cycle to g1 (window
  QUIESCED -> READY, transfer GB/s, per-chunk CUDA-event timings); a packing sweep (each transfer
  validated); the trainer-side packing cost alone; then ``b``.
* ``b``: restart-to-serving time of the same server (stop + start + first completion), then its
  recovery (TAINTED -> RECOVERING -> bootstrap over NCCL again).
* ``c``: two replicas; continuous load (``--workers`` concurrent rollouts through store
  admission, ``max_staleness=1``); ``--rolls`` rolling updates across both replicas; every rollout
  verified against its bound generation.
* ``d``: stuck collective: r1's update is sent from a sending *child process* by a checkpoint
  source (the checkpoint loaded onto GPU 0) that stalls mid-broadcast; the child is then
  SIGKILLed; r1 must be TAINTED within the transfer deadline while r0 keeps serving; r0 then
  moves to that generation in process; r1 is restarted and recovered from the checkpoint in
  service mode (a fresh sending child).

Each run writes ``--out`` (JSON; rewritten after every phase, so a crash keeps what was
measured). ``python -m bench.gpu_update merge PART.json... `` combines parts into
``bench/results/gpu_update.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.harness import (
    MIB,
    RESULTS,
    Env,
    Load,
    StallingCheckpointSource,
    Trainer,
    gen,
    gpu_info,
    identity,
    nccl_config,
    now,
    phase_raw,
    record_pids,
    save_checkpoint,
    shutdown,
    start_pool,
    start_replicas_with_trainer,
    target,
    tf_check,
    verify_rollouts,
)
from pool.evidence import LabelEvidence, ValidationEvidence
from pool.types import (
    Generation,
)


def make_runner(
    store: Any, lease: Any, transport: Any, trainer: Trainer, deadlines: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """A CycleRunner whose validation step is the teacher-forced check (see module doc), and the
    list each of its checks is appended to."""
    from updater.cycle import CycleRunner

    checks: list[dict[str, Any]] = []

    async def teacher_forced(h: Any, gen: Generation, probe: Any) -> ValidationEvidence:
        await h.engine.resume()
        res = await tf_check(trainer, h.engine.url, gen.label)
        res["replica"] = h.replica_id
        checks.append(res)
        ok = res["ok"] and trainer.generation == gen.number
        return ValidationEvidence(
            gen, LabelEvidence(False, None), (1,), (1,) if ok else (0,), detail=json.dumps(res)
        )

    runner = CycleRunner(store, lease, transport, deadlines=deadlines, validator=teacher_forced)
    return runner, checks


# ------------------------------------------------------------------------------ phase raw


# ------------------------------------------------------------------------------ phase a + b


def pack_only_seconds(trainer: Trainer, packing_bytes: int) -> float:
    """vLLM's own trainer-side packing (``pack_tensors``) of all weights, no broadcast."""
    torch = trainer.torch
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    def once() -> float:
        it = ((n, p.detach()) for n, p in trainer.model.named_parameters())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while pack_tensors(it, lambda x: x[1], packing_bytes) is not None:
            pass
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(3))


def chunk_summary(chunks: list[dict[str, float]], raw_gbps: float | None) -> dict[str, Any]:
    if not chunks:
        return {}
    span = chunks[-1]["end_ms"] - chunks[0]["start_ms"]
    nbytes = sum(c["bytes"] for c in chunks)
    gaps = [max(0.0, b["start_ms"] - a["end_ms"]) for a, b in itertools.pairwise(chunks)]
    out: dict[str, Any] = {
        "chunks": len(chunks),
        "bytes": nbytes,
        "span_ms": round(span, 2),
        "kernel_ms_sum": round(sum(c["kernel_ms"] for c in chunks), 2),
        "gap_ms_sum": round(sum(gaps), 2),
        "span_GBps": round(nbytes / span / 1e6, 1) if span else None,
        "per_chunk": [
            {
                "MiB": round(c["bytes"] / MIB, 1),
                "kernel_ms": round(c["kernel_ms"], 2),
                "start_ms": round(c["start_ms"], 2),
            }
            for c in chunks
        ],
    }
    if raw_gbps:
        out["wire_ms_at_raw"] = round(nbytes / raw_gbps / 1e6, 2)
    return out


async def phase_a(env: Env) -> None:
    from updater.cycle import Deadlines
    from updater.transports.nccl import ModuleSource, NcclTransport, Packing

    a, res = env.args, env.result
    starts = await start_replicas_with_trainer(env, ["r0"])
    res["cold_start_s"] = round(starts["r0"], 1)
    trainer = env.trainer
    assert trainer is not None
    h = env.handles["r0"]
    url = h.engine.url
    transport = NcclTransport(nccl_config(env, chunk_timings=True), ModuleSource(trainer.model))
    env.result["_transport"] = transport  # for phase b (not serialised)
    runner, checks = make_runner(
        env.store, env.lease, transport, trainer, Deadlines(transfer_s=120)
    )
    env.result["_runner"] = runner

    trainer.set_generation(0)
    pre = await tf_check(trainer, url, "g0")  # dummy weights vs g0: must NOT match
    t0 = now()
    rep = await runner.bootstrap(
        h, gen(0), identity(env, 0), target(env, 0).probe, checkpoint=Path("/in-process/g0")
    )
    res["bootstrap"] = {
        "report": rep.model_dump(mode="json"),
        "wall_s": round(now() - t0, 3),
        "transfer": transport.last.get(url),
        "dummy_vs_g0": pre,
    }
    print(
        f"bootstrap g0: {rep.model_dump(mode='json')} init+transfer {transport.last.get(url)}",
        flush=True,
    )
    env.save()

    # (a) one full cycle g0 -> g1
    trainer.set_generation(1)
    before = await tf_check(trainer, url, "g0")  # replica on g0 vs trainer g1: no match
    t0 = now()
    rep = await runner.run(h, target(env, 1))
    last = dict(transport.last[url])
    chunks = last.pop("chunks", [])
    raw = res.get("raw_nccl_GBps")
    res["cycle"] = {
        "report": rep.model_dump(mode="json"),
        "wall_s": round(now() - t0, 3),
        "transfer": last,
        "chunks": chunk_summary(chunks, raw),
        "g0_replica_vs_g1": before,
        "check": checks[-1],
    }
    res["transfer_s"] = round(last["transfer_s"], 4)
    res["transfer_GBps"] = round(last["GBps"], 1)
    res["window_s"] = rep.window_s
    print(
        f"cycle g1: window {rep.window_s:.3f}s transfer {last['transfer_s']:.3f}s "
        f"({last['GBps']:.1f} GB/s) phases {rep.phases}",
        flush=True,
    )
    env.save()

    # packing sweep: same weights (g1) re-sent; each transfer validated
    sweep: list[dict[str, Any]] = []
    configs = [
        (1024, 2),
        (1024, 2),
        (1024, 2),
        (512, 4),
        (256, 8),
        (2048, 2),
        (2048, 4),
        (4096, 2),
        (128, 16),
        (0, 0),
    ]
    for mb, nb in configs:
        packing = Packing(packed=mb > 0, buffer_bytes=max(mb, 1) * MIB, num_buffers=max(nb, 1))
        transport.packing = packing
        row: dict[str, Any] = {"buffer_MiB": mb, "num_buffers": nb, "packed": mb > 0}
        try:
            await h.engine.pause("wait", clear_cache=False)
            ev = await transport.transfer(h.engine, _wt(env, h, 1))
            await h.engine.reset_caches()
            await h.engine.resume()
            chk = await tf_check(trainer, url, f"sweep{len(sweep)}")
            last = dict(transport.last[url])
            row.update(
                {
                    "transfer_s": round(ev.elapsed_s, 4),
                    "GBps": round(ev.bytes / ev.elapsed_s / 1e9, 1),
                    "send_s": round(last.get("send_s", 0), 4),
                    "update_http_s": round(last.get("update_http_s", 0), 4),
                    "start_s": round(last.get("start_s", 0), 4),
                    "finish_s": round(last.get("finish_s", 0), 4),
                    "chunks": {
                        k: v
                        for k, v in chunk_summary(last.get("chunks", []), raw).items()
                        if k != "per_chunk"
                    },
                    "valid": chk["ok"],
                    "check": chk,
                }
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            with contextlib.suppress(Exception):
                await h.engine.resume()
        sweep.append(row)
        print(
            f"sweep {mb}MiB x{nb}: {row.get('GBps')} GB/s valid={row.get('valid')} "
            f"{row.get('error', '')}",
            flush=True,
        )
        if "error" in row:
            break
    transport.packing = nccl_config(env).packing
    res["sweep"] = sweep
    with contextlib.suppress(Exception):
        res["trainer_pack_only_s"] = round(
            await asyncio.to_thread(pack_only_seconds, trainer, a.buffer_mb * MIB), 4
        )
    env.save()


def _wt(env: Env, h: Any, g: int) -> Any:
    from updater.transports.base import WeightsTarget

    t = target(env, g)
    return WeightsTarget(identity=t.identity, path=t.path, expected_manifest=h.manifest)


async def phase_b(env: Env) -> None:
    res = env.result
    transport: Any = res.get("_transport")
    runner: Any = res.get("_runner")
    trainer = env.trainer
    assert trainer is not None and transport is not None
    h = env.handles["r0"]
    rep = env.replicas["r0"]
    g = trainer.generation or 0
    await runner._taint(h, "planned restart", RuntimeError("restart measurement"))
    await runner.start_recovery(h, "planned restart (measurement)")
    t0 = now()
    await rep.stop()
    stop_s = now() - t0
    rep._proc = None
    start_s = await rep.start()
    restart_wall = now() - t0
    transport.forget(h.engine.url)
    t1 = now()
    report = await runner.bootstrap(
        h, gen(g), identity(env, g), target(env, g).probe, checkpoint=Path(f"/in-process/g{g}")
    )
    res["restart"] = {
        "stop_s": round(stop_s, 2),
        "start_to_serving_s": round(start_s, 2),
        "wall_s": round(restart_wall, 2),
        "bootstrap_after_restart_s": round(now() - t1, 3),
        "bootstrap": report.model_dump(mode="json"),
        "transfer": {k: v for k, v in transport.last[h.engine.url].items() if k != "chunks"},
    }
    res["restart_s"] = round(start_s, 2)
    if res.get("window_s"):
        res["restart_over_hot"] = round(start_s / res["window_s"], 1)
    print(f"restart: {res['restart']}", flush=True)
    env.save()


# ------------------------------------------------------------------------------ phase c + d


async def phase_c(env: Env) -> None:
    from updater.cycle import CycleError, Deadlines
    from updater.transports.nccl import ModuleSource, NcclTransport

    a, res = env.args, env.result
    rids = ["r0", "r1"]
    starts = await start_replicas_with_trainer(env, rids)
    res["starts_s"] = {k: round(v, 1) for k, v in starts.items()}
    trainer = env.trainer
    assert trainer is not None
    transport = NcclTransport(nccl_config(env), ModuleSource(trainer.model))
    runner, _ = make_runner(env.store, env.lease, transport, trainer, Deadlines(transfer_s=120))
    res["_runner"], res["_transport"] = runner, transport
    trainer.set_generation(0)
    boots = {}
    for rid in rids:
        rep = await runner.bootstrap(
            env.handles[rid],
            gen(0),
            identity(env, 0),
            target(env, 0).probe,
            checkpoint=Path("/in-process/g0"),
        )
        boots[rid] = {
            "report": rep.model_dump(mode="json"),
            "transfer_GBps": round(transport.last[env.handles[rid].engine.url].get("GBps", 0), 1),
        }
    res["rolling_bootstrap"] = boots
    env.save()

    load = Load(env, rids)
    res["_load"] = load
    load.start(a.workers)
    await asyncio.sleep(a.settle_s)
    updates = []
    g = 0
    for _ in range(a.rolls):
        g += 1
        trainer.set_generation(g)
        for rid in rids:
            t0 = now()
            try:
                rep = await runner.run(env.handles[rid], target(env, g))
                updates.append(
                    {
                        "replica": rid,
                        "generation": g,
                        "outcome": rep.outcome,
                        "window_s": rep.window_s,
                        "phases": rep.model_dump(mode="json")["phases"],
                        "GBps": round(transport.last[env.handles[rid].engine.url]["GBps"], 1),
                        "wall_s": round(now() - t0, 3),
                    }
                )
            except CycleError as e:
                updates.append(
                    {
                        "replica": rid,
                        "generation": g,
                        "outcome": e.report.outcome,
                        "reason": e.report.reason,
                    }
                )
            print(f"rolling: {updates[-1]}", flush=True)
            await asyncio.sleep(a.settle_s)
    res["rolling_updates"] = updates
    res["g_latest"] = g
    if "d" not in a.phases:
        await load.finish()
        await finish_rolling(env, load, list(range(g + 1)), updates)


async def finish_rolling(
    env: Env, load: Load, generations: list[int], updates: list[dict[str, Any]]
) -> None:
    res = env.result
    ver = await verify_rollouts(env, load.records, generations)
    res["rolling"] = {
        "replicas": 2,
        "updates": sum(u["outcome"] == "ready" for u in updates),
        "rollouts": ver["rollouts"],
        "cross_generation": ver["cross_generation"],
        "verification": ver,
        "admission_refused": load.refused,
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "workers": env.args.workers,
    }
    print(f"rolling: {res['rolling']}", flush=True)
    env.save()


async def phase_d(env: Env) -> None:
    from updater.cycle import CycleError, Deadlines
    from updater.transports.nccl import NcclTransport, ProcessSender

    a, res = env.args, env.result
    trainer = env.trainer
    runner: Any = res["_runner"]
    load: Load = res["_load"]
    assert trainer is not None
    h0, h1 = env.handles["r0"], env.handles["r1"]
    g = res["g_latest"] + 1
    trainer.set_generation(g)
    path, save_s = await asyncio.to_thread(save_checkpoint, trainer, env.work)
    stuck: dict[str, Any] = {"checkpoint": str(path), "checkpoint_save_s": round(save_s, 1)}
    res["stuck"] = stuck
    env.save()
    flag = env.work / "stall.flag"
    flag.unlink(missing_ok=True)
    n_tensors = len(env.manifest.tensors) if env.manifest else 0
    stall = StallingCheckpointSource(str(path), "cuda:0", n_tensors // 2, str(flag))
    bad = NcclTransport(nccl_config(env, master_port=a.nccl_port + 20), stall, sender="process")
    deadline = a.stuck_deadline_s
    bad_runner, _ = make_runner(
        env.store, env.lease, bad, trainer, Deadlines(transfer_s=deadline, preflight_s=300)
    )
    served_before = sum(1 for r in load.records if r["replica"] == "r0")
    t_start = now()
    task = asyncio.create_task(bad_runner.run(h1, target(env, g, path)))
    while not flag.exists() and not task.done() and now() - t_start < 300:
        await asyncio.sleep(0.02)
    if task.done():
        stuck["error"] = f"cycle ended before the stall: {task.exception()!r}"
        stuck["transfer"] = {
            k: v for k, v in bad.last.get(h1.engine.url, {}).items() if k != "chunks"
        }
        env.save()
        await load.finish()
        bad.close()
        await finish_rolling(env, load, list(range(g)), res.get("rolling_updates", []))
        return
    await asyncio.sleep(0.5)  # chunks before the stall land; r1's worker now waits in NCCL
    assert isinstance(bad.sender, ProcessSender)
    pid = bad.sender.pid
    assert pid is not None
    t_kill = now()
    os.kill(pid, signal.SIGKILL)
    outcome = None
    try:
        await task
    except CycleError as e:
        outcome = e.report.model_dump(mode="json")
    t_tainted = now()
    rec = await env.store.replica("r1")
    stuck.update(
        {
            "deadline_s": deadline,
            "killed_pid": pid,
            "transfer_started_to_kill_s": round(t_kill - t_start, 2),
            "tainted_after_s": round(t_tainted - t_kill, 3),
            "tainted_after_transfer_start_s": round(t_tainted - t_start, 2),
            "store_state": rec.state.value,
            "reason": rec.reason,
            "cycle": outcome,
            "transfer": {k: v for k, v in bad.last.get(h1.engine.url, {}).items() if k != "chunks"},
        }
    )
    # r1's engine loop is blocked inside the NCCL receive: /health answers, utility calls hang
    async with httpx.AsyncClient() as c:
        try:
            hr = await c.get(f"{h1.engine.url}/health", timeout=5)
            stuck["r1_health_status"] = hr.status_code
        except Exception as e:
            stuck["r1_health_status"] = repr(e)
        try:
            await c.get(f"{h1.engine.url}/is_paused", timeout=5)
            stuck["r1_engine_loop"] = "answered"
        except httpx.TimeoutException:
            stuck["r1_engine_loop"] = "blocked (GET /is_paused timed out after 5 s)"
    print(f"stuck: {stuck}", flush=True)
    env.save()

    # r0 moves to g in process; r1 restarts and recovers from the checkpoint (service mode)
    try:
        rep0 = await runner.run(h0, target(env, g))
        stuck["r0_update"] = {"outcome": rep0.outcome, "window_s": rep0.window_s}
    except CycleError as e:
        stuck["r0_update"] = {"outcome": e.report.outcome, "reason": e.report.reason}
    service = NcclTransport(nccl_config(env, master_port=a.nccl_port + 30), sender="process")
    svc_runner, svc_checks = make_runner(
        env.store, env.lease, service, trainer, Deadlines(transfer_s=120, preflight_s=300)
    )
    t0 = now()
    await svc_runner.start_recovery(h1, "stuck collective: restart")
    restart_s = await env.replicas["r1"].restart()
    served_during = (
        sum(1 for r in load.records if r["replica"] == "r0" and r["t1"] > 0) - served_before
    )
    try:
        report = await svc_runner.bootstrap(
            h1, gen(g), identity(env, g, str(path)), target(env, g).probe, checkpoint=path
        )
        stuck["recovery"] = {
            "outcome": report.outcome,
            "phases": report.model_dump(mode="json")["phases"],
            "restart_s": round(restart_s, 1),
            "total_s": round(now() - t0, 1),
            "service_transfer": {
                k: v for k, v in service.last.get(h1.engine.url, {}).items() if k != "chunks"
            },
            "check": svc_checks[-1] if svc_checks else None,
        }
        stuck["recovered"] = report.outcome == "ready"
    except CycleError as e:
        stuck["recovery"] = {"outcome": e.report.outcome, "reason": e.report.reason}
        stuck["recovered"] = False
    stuck["r0_rollouts_while_r1_down"] = served_during
    env.save()
    await asyncio.sleep(a.settle_s)
    await load.finish()
    bad.close()
    service.close()
    with contextlib.suppress(Exception):
        shutil.rmtree(path)
    await finish_rolling(env, load, list(range(g + 1)), res.get("rolling_updates", []))


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    os.makedirs(work, exist_ok=True)
    env = Env(
        args,
        {"phases": args.phases, "model": args.model, "argv": sys.argv, "gpu": gpu_info()},
        work,
    )
    try:
        from updater.transports.nccl import local_vllm_version

        env.result["vllm_version"] = local_vllm_version()
    except Exception:
        pass
    try:
        if "raw" in args.phases:
            await asyncio.to_thread(phase_raw, env)
            env.save()
        if any(p in args.phases for p in ("a", "b", "c", "d")):
            env.result["_pids"] = asyncio.create_task(record_pids(env))
            await start_pool(env)
        if "a" in args.phases:
            await phase_a(env)
            if "b" in args.phases:
                await phase_b(env)
        if "c" in args.phases:
            await phase_c(env)
            if "d" in args.phases:
                await phase_d(env)
    except BaseException as e:
        env.result["fatal"] = f"{type(e).__name__}: {e}"
        env.result["traceback"] = traceback.format_exc()[-4000:]
        print(env.result["traceback"], flush=True)
    finally:
        for k in [k for k in env.result if k.startswith("_")]:
            obj = env.result.pop(k)
            if isinstance(obj, asyncio.Task):
                obj.cancel()
            elif hasattr(obj, "close"):
                with contextlib.suppress(Exception):
                    obj.close()
        env.save()
        await shutdown(env)
        for rid, rep in env.replicas.items():
            with contextlib.suppress(Exception):
                tail = rep.log_tail(60)
                (Path(args.out).parent / f"server-{rid}.log").write_text(tail)
    return env.result


def breakdown(part: dict[str, Any]) -> dict[str, Any]:
    """Where the time of one cycle's transfer goes (phase ``a``'s 1 GiB x 2 cycle)."""
    cycle, raw = part["cycle"], part.get("raw_nccl_GBps")
    t, ch = cycle["transfer"], cycle["chunks"]
    nbytes = t["bytes"]
    chunks = ch.get("per_chunk", [])
    starts = [c["start_ms"] for c in chunks]
    steady = sorted(b - a for a, b in itertools.pairwise(starts[2:]))
    per_chunk_mib = statistics.median([c["MiB"] for c in chunks]) if chunks else 0.0
    wire_chunk_ms = per_chunk_mib * MIB / raw / 1e6 if raw else None
    first_wire_ms = chunks[0]["MiB"] * MIB / raw / 1e6 if (raw and chunks) else None
    out: dict[str, Any] = {
        "bytes": nbytes,
        "raw_nccl_GBps": raw,
        "wire_at_raw_s": round(nbytes / raw / 1e9, 4) if raw else None,
        "trainer_pack_s": part.get("trainer_pack_only_s"),
        "transfer_s": round(t["transfer_s"], 4),
        "transfer_GBps": round(nbytes / t["transfer_s"] / 1e9, 1),
        "start_weight_update_s": round(t["start_s"], 4),
        "update_weights_s": round(t["update_http_s"], 4),
        "update_weights_GBps": round(nbytes / t["update_http_s"] / 1e9, 1),
        "finish_weight_update_s": round(t["finish_s"], 4),
        "broadcast_span_s": round(ch["span_ms"] / 1e3, 4),
        "broadcast_span_GBps": ch.get("span_GBps"),
        "chunks": ch.get("chunks"),
        "first_chunk_s": round(chunks[0]["kernel_ms"] / 1e3, 4) if chunks else None,
        "first_chunk_wire_s": round(first_wire_ms / 1e3, 4) if first_wire_ms else None,
        "steady_chunk_interval_ms": round(steady[len(steady) // 2], 2) if steady else None,
        "steady_chunk_wire_ms": round(wire_chunk_ms, 2) if wire_chunk_ms else None,
        "update_tail_s": round(t["update_http_s"] - ch["span_ms"] / 1e3, 4),
    }
    best = max(
        (r for r in part.get("sweep", []) if r.get("valid")),
        key=lambda r: r.get("GBps", 0),
        default=None,
    )
    if best:
        out["best_sweep"] = {
            k: best.get(k)
            for k in ("buffer_MiB", "num_buffers", "GBps", "update_http_s", "start_s", "finish_s")
        }
    return out


def merge(
    parts: list[Path], out: Path, command: str, notes: list[str] | None = None
) -> dict[str, Any]:
    """Combine phase outputs into one result file (``bench/results/gpu_update.json`` by
    default): the headline fields on top (first part that has each), the transfer breakdown,
    every part in ``details``."""
    datas = {p.stem: json.loads(p.read_text()) for p in parts}
    keys = [
        "bytes",
        "transfer_s",
        "transfer_GBps",
        "window_s",
        "restart_s",
        "restart_over_hot",
        "rolling",
        "stuck",
        "raw_nccl_GBps",
        "vllm_version",
        "gpu",
    ]
    result: dict[str, Any] = {
        k: next((d[k] for d in datas.values() if d.get(k) is not None), None) for k in keys
    }
    if isinstance(result["stuck"], dict):
        s = result["stuck"]
        result["stuck"] = {
            "deadline_s": s.get("deadline_s"),
            "tainted_after_s": s.get("tainted_after_s"),
            "recovered": s.get("recovered"),
            **s,
        }
    if isinstance(result["rolling"], dict):
        r = result["rolling"]
        result["rolling"] = {
            "replicas": r.get("replicas"),
            "updates": r.get("updates"),
            "rollouts": r.get("rollouts"),
            "cross_generation": r.get("cross_generation"),
            **r,
        }
    result["command"] = command
    if notes:
        result["notes"] = notes
    with_cycle = next((d for d in datas.values() if "cycle" in d), None)
    if with_cycle is not None:
        result["breakdown"] = breakdown(with_cycle)
    result["details"] = datas
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":
        ap = argparse.ArgumentParser(prog="python -m bench.gpu_update merge")
        ap.add_argument("parts", nargs="+", type=Path)
        ap.add_argument("--out", type=Path, default=RESULTS / "gpu_update.json")
        ap.add_argument("--command", default="")
        ap.add_argument("--note", action="append", default=[])
        m = ap.parse_args(argv[1:])
        merge(m.parts, m.out, m.command, m.note)
        print(f"wrote {m.out}")
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_update",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--phases", default="raw,a,b", help="raw,a,b,c,d (comma-separated)")
    ap.add_argument("--model", default="/tmp/models/qwen3-8b-shape")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_update_part.json")
    )
    ap.add_argument("--work", default="/tmp/gpu-bench")
    ap.add_argument("--nccl-bw", default="/tmp/stage/nccl_bw.py")
    ap.add_argument("--nccl-port", type=int, default=29555)
    ap.add_argument("--replica-gpu", default="1")
    ap.add_argument("--gpu-util", type=float, default=0.4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--buffer-mb", type=int, default=1024)
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rolls", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--stuck-deadline-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    result = asyncio.run(amain(args))
    print(
        json.dumps(
            {
                k: result.get(k)
                for k in (
                    "bytes",
                    "transfer_s",
                    "transfer_GBps",
                    "window_s",
                    "restart_s",
                    "restart_over_hot",
                    "raw_nccl_GBps",
                    "fatal",
                )
            },
            default=str,
        ),
        flush=True,
    )
    return 1 if "fatal" in result else 0


if __name__ == "__main__":
    sys.exit(main())
