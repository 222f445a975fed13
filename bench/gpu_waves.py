"""Update waves (one NCCL broadcast for k replicas) and a TP=2 replica, 4x H200.

Runs on the 4-GPU host (``tests/gpu/README.md``), never in CI; one run of ~5 min. Trainer and
sender on GPU 0 (this process, ``CUDA_VISIBLE_DEVICES=0``), replicas ``r1``..``r3`` on GPUs 1-3
(one each, started together), RolloutPool's worker extension loaded, ``--load-format dummy``,
``--enforce-eager`` by default (start-up time). Every cycle goes through the project's
:class:`~updater.cycle.CycleRunner` (fenced store transitions, deadlines, checksums compared in
VALIDATING, then the teacher-forced check against the *target* generation's references) driving
:class:`~updater.transports.nccl.direct.NcclDirectTransport`, as :mod:`bench.gpu_direct` does.

Phases, in order (``--out`` is rewritten after each):

* ``waves``: for k = 2 and 3, ``--reps`` + 1 times each: the k replicas updated one after the
  other (k transfers), then the same k as one wave (``expect_wave``, as the updater announces a
  batch: one group, one broadcast per tensor). The first wave of each k creates its group (its
  time is reported apart). Time per wave and per replica.
* ``rolling``: ``--workers`` rollouts in flight through store admission (``max_staleness=1``)
  while ``--rolls`` generations roll out as the updater plans them with ``max_unavailable=2``:
  r1 alone first (it publishes), then r2 + r3 as one wave; every rollout verified against its
  bound generation (0 cross-generation expected).
* ``tp2``: r2 and r3 stop; ``t0`` starts with ``--tensor-parallel-size 2`` on GPUs 2-3; it is
  bootstrapped and then updated ``--tp-cycles`` times alone over the fast path (checksums per
  rank, teacher-forced check), then once in a wave with r1 (a TP=1 and a TP=2 replica, one
  broadcast).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.gpu.cycles import Refs, make_runner, new_generation, run_cycle
from bench.gpu.harness import (
    TF_MAX_TOL,
    TF_MEAN_TOL,
    Env,
    Load,
    Trainer,
    attach,
    gen,
    gpu_info,
    identity,
    nccl_config,
    record_pids,
    replica_spec,
    shutdown,
    start_pool,
    target,
    verify_rollouts,
)

GPUS = {"r1": "1", "r2": "2", "r3": "3"}


def now() -> float:
    return time.monotonic()


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


# ------------------------------------------------------------------------------ set-up


def spec_for(env: Env, rid: str, gpus: str, tp: int = 1) -> Any:
    spec = replica_spec(env, rid)
    extra = spec.extra_args + (("--tensor-parallel-size", str(tp)) if tp > 1 else ())
    return spec.model_copy(update={"cuda_visible_devices": gpus, "extra_args": extra})


async def start(env: Env, rid: str, gpus: str, tp: int = 1) -> float:
    from pool.launcher import LocalReplica

    rep = LocalReplica(spec_for(env, rid, gpus, tp))
    env.replicas[rid] = rep
    return await rep.start()


async def build_trainer(env: Env) -> None:
    t0 = now()
    env.trainer = await asyncio.to_thread(Trainer, Path(env.args.model))
    env.manifest = await asyncio.to_thread(env.trainer.manifest)
    env.result["bytes"] = env.trainer.nbytes()
    env.result["tensors"] = len(env.manifest.tensors)
    env.result["trainer_build_s"] = round(now() - t0, 1)


async def set_up(env: Env) -> tuple[Any, Any, Refs]:
    """Trainer (GPU 0) and r1..r3 (GPUs 1-3) started together; all bootstrapped to g0."""
    from updater.transports.nccl import ModuleSource
    from updater.transports.nccl.direct import NcclDirectTransport

    a, res = env.args, env.result
    t0 = now()
    starts = await asyncio.gather(
        build_trainer(env), *(start(env, rid, gpu) for rid, gpu in GPUS.items())
    )
    res["start_s"] = {rid: round(float(s or 0), 1) for rid, s in zip(GPUS, starts[1:], strict=True)}
    res["set_up_s"] = round(now() - t0, 1)
    for rid in GPUS:
        await attach(env, rid)
    trainer = env.trainer
    assert trainer is not None
    refs = Refs(trainer)
    refs.mean_tol, refs.max_tol = a.tf_mean_tol, a.tf_max_tol
    transport = NcclDirectTransport(
        nccl_config(
            env,
            master_port=a.nccl_port,
            wave_gather_s=a.gather_s,
            wave_receive_timeout_s=a.wave_receive_timeout_s,
        ),
        ModuleSource(trainer.model),
    )
    runner = make_runner(env, transport, refs)
    new_generation(env, refs, 0)
    boots = {}
    for rid in GPUS:
        t = now()
        h = env.handles[rid]
        rep = await runner.bootstrap(h, gen(0), identity(env, 0), target(env, 0).probe, Path("/g0"))
        boots[rid] = {"outcome": rep.outcome, "wall_s": round(now() - t, 3)}
    res["bootstrap"] = boots
    res["g_latest"] = 0
    print(f"set up: {res['start_s']} bootstrap {boots}", flush=True)
    env.save()
    return transport, runner, refs


async def one_wave(
    env: Env, runner: Any, transport: Any, rids: list[str], g: int
) -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
    """``rids`` updated to ``g`` as one wave; (wall seconds, cycle rows, the wave's row)."""
    transport.expect_wave([env.handles[r].engine.url for r in rids])
    transport.last_waves.clear()
    t0 = now()
    rows = await asyncio.gather(*(run_cycle(env, runner, transport, r, g) for r in rids))
    wall = now() - t0
    wave = transport.last_waves[-1] if transport.last_waves else {}
    return wall, list(rows), {k: v for k, v in wave.items() if k != "checksums"}


async def one_by_one(
    env: Env, runner: Any, transport: Any, rids: list[str], g: int
) -> tuple[float, list[dict[str, Any]]]:
    t0 = now()
    rows = [await run_cycle(env, runner, transport, r, g) for r in rids]
    return now() - t0, rows


def ready(rows: list[dict[str, Any]]) -> bool:
    return all(r.get("outcome") == "ready" for r in rows)


def transfer_s(rows: list[dict[str, Any]]) -> list[float]:
    return [r["transfer"]["transfer_s"] for r in rows if r.get("outcome") == "ready"]


# ------------------------------------------------------------------------------ phases


async def phase_waves(env: Env, runner: Any, transport: Any, refs: Refs) -> None:
    a, res = env.args, env.result
    out: dict[str, Any] = res.setdefault("waves", {})
    g = res["g_latest"]
    for k in (2, 3):
        rids = list(GPUS)[:k]
        reps: list[dict[str, Any]] = []
        for i in range(a.reps + 1):
            g += 1
            new_generation(env, refs, g)
            seq_s, seq_rows = await one_by_one(env, runner, transport, rids, g)
            g += 1
            new_generation(env, refs, g)
            wave_s, wave_rows, wave = await one_wave(env, runner, transport, rids, g)
            reps.append(
                {
                    "warm_up": i == 0,
                    "sequential_s": round(seq_s, 4),
                    "wave_s": round(wave_s, 4),
                    "sequential": seq_rows,
                    "wave": wave_rows,
                    "broadcast": wave,
                }
            )
            print(
                f"k={k} rep {i}: sequential {seq_s:.3f}s ({ready(seq_rows)}) wave {wave_s:.3f}s "
                f"({ready(wave_rows)}) broadcast {wave.get('transfer_s')} "
                f"init {wave.get('init_s')}",
                flush=True,
            )
            res["g_latest"] = g
            env.save()
        timed = [r for r in reps if not r["warm_up"]] or reps
        out[f"k{k}"] = {
            "replicas_per_broadcast": k,
            "wave_s": med([r["wave_s"] for r in timed]),
            "sequential_s": med([r["sequential_s"] for r in timed]),
            "wave_per_replica_s": med([r["wave_s"] / k for r in timed]),
            "sequential_per_replica_s": med([r["sequential_s"] / k for r in timed]),
            "broadcast_transfer_s": med([r["broadcast"].get("transfer_s", 0.0) for r in timed]),
            "broadcast_GBps": med([r["broadcast"].get("GBps", 0.0) for r in timed]),
            "one_transfer_alone_s": med([x for r in timed for x in transfer_s(r["sequential"])]),
            "group_init_s": reps[0]["broadcast"].get("init_s"),
            "all_ready": all(ready(r["sequential"]) and ready(r["wave"]) for r in reps),
            "checks_ok": all(
                (c.get("check") or {}).get("ok", True) for r in reps for c in r["wave"]
            ),
            "reps": reps,
        }
        ws, ss = out[f"k{k}"]["wave_s"], out[f"k{k}"]["sequential_s"]
        if ws and ss:
            out[f"k{k}"]["sequential_over_wave"] = round(ss / ws, 2)
        env.save()


async def phase_rolling(env: Env, runner: Any, transport: Any, refs: Refs) -> None:
    a, res = env.args, env.result
    rids = list(GPUS)
    g0 = res["g_latest"]
    load = Load(env, rids)
    load.start(a.workers)
    await asyncio.sleep(a.settle_s)
    rolls = []
    g = g0
    for _ in range(a.rolls):
        g += 1
        new_generation(env, refs, g)
        t0 = now()
        first = await run_cycle(env, runner, transport, rids[0], g)  # publishes g
        wall, rows, wave = await one_wave(env, runner, transport, rids[1:], g)
        rolls.append(
            {
                "generation": g,
                "first": first,
                "wave": rows,
                "broadcast": wave,
                "roll_s": round(now() - t0, 3),
                "wave_s": round(wall, 3),
            }
        )
        res["g_latest"] = g
        print(f"rolling g{g}: {rolls[-1]['roll_s']}s wave {wall:.3f}s", flush=True)
        await asyncio.sleep(a.settle_s)
    await load.finish()
    ver = await verify_rollouts(env, load.records, list(range(max(0, g0 - 1), g + 1)))
    checks = [c for c in refs.checks if c["generation"] > g0]
    res["rolling"] = {
        "replicas": len(rids),
        "max_unavailable": 2,
        "updates": sum(
            r.get("outcome") == "ready" for x in rolls for r in [x["first"], *x["wave"]]
        ),
        "rollouts": ver["rollouts"],
        "cross_generation": ver["cross_generation"],
        "teacher_forced_checks": len(checks),
        "teacher_forced_ok": sum(1 for c in checks if c["ok"]),
        "verification": ver,
        "rolls": rolls,
        "admission_refused": load.refused,
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "workers": a.workers,
    }
    print({k: v for k, v in res["rolling"].items() if k not in ("rolls", "verification")})
    env.save()


async def phase_tp2(env: Env, runner: Any, transport: Any, refs: Refs) -> None:
    a, res = env.args, env.result
    out: dict[str, Any] = res.setdefault("tp2", {})
    for rid in ("r2", "r3"):
        with contextlib.suppress(Exception):
            await env.replicas[rid].stop(grace_s=5)
        transport.forget(env.handles[rid].engine.url)
    t0 = now()
    out["start_s"] = round(await start(env, "t0", "2,3", tp=2), 1)
    await attach(env, "t0")
    h = env.handles["t0"]
    g = res["g_latest"]
    new_generation(env, refs, g)
    boot = await runner.bootstrap(h, gen(g), identity(env, g), target(env, g).probe, Path("/g"))
    out["bootstrap"] = {"outcome": boot.outcome, "wall_s": round(now() - t0, 2)}
    out["bootstrap_transfer"] = transport.last.get(h.engine.url)
    env.save()
    rows = []
    for _ in range(a.tp_cycles):
        g += 1
        new_generation(env, refs, g)
        row = await run_cycle(env, runner, transport, "t0", g)
        row["check"] = refs.checks[-1] if refs.checks else None
        rows.append(row)
        print(f"tp2 g{g}: {row.get('outcome')} {row.get('transfer', {}).get('GBps')}", flush=True)
        res["g_latest"] = g
        env.save()
    ok = [r for r in rows if r.get("outcome") == "ready"]
    sums = [r["phases"].get("checksum") for r in ok]
    out.update(
        {
            "replica": "t0: --tensor-parallel-size 2 on GPUs 2-3",
            "cycles": rows,
            "ready": len(ok),
            "verified": bool(ok)
            and len(ok) == len(rows)
            and all((r.get("check") or {}).get("ok") for r in ok),
            "transfer_s": med([r["transfer"]["transfer_s"] for r in ok]),
            "transfer_GBps": med([r["transfer"]["GBps"] for r in ok]),
            "rank_receive_s": med(
                [x["receive_s"] for r in ok for x in r["transfer"]["receive"].get("ranks", [])]
            ),
            "window_s": med([r["window_s"] for r in ok]),
            "checksum_compare_s": med([s for s in sums if s is not None]),
        }
    )
    env.save()
    g += 1  # one broadcast to a TP=1 (r1) and a TP=2 replica (t0): 4 ranks
    new_generation(env, refs, g)
    wall, wrows, wave = await one_wave(env, runner, transport, ["r1", "t0"], g)
    out["wave_with_r1"] = {"wave_s": round(wall, 3), "cycles": wrows, "broadcast": wave}
    out["wave_with_r1_ready"] = ready(wrows)
    res["g_latest"] = g
    env.save()


# ------------------------------------------------------------------------------ main


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    os.makedirs(work, exist_ok=True)
    env = Env(args, {"model": args.model, "gpu": gpu_info(), "argv": sys.argv}, work)
    with contextlib.suppress(Exception):
        from updater.transports.nccl import local_vllm_version

        env.result["vllm_version"] = local_vllm_version()
    t_start = now()
    try:
        env.result["_pids"] = asyncio.create_task(record_pids(env))
        await start_pool(env)
        transport, runner, refs = await set_up(env)
        env.result["_transport"] = transport
        env.result["_refs"] = refs
        for name, fn in (("waves", phase_waves), ("rolling", phase_rolling), ("tp2", phase_tp2)):
            if name not in args.phases:
                continue
            if now() - t_start > args.budget_s and name != "tp2":
                env.result.setdefault("skipped", []).append(f"{name}: over --budget-s")
                continue
            try:
                await fn(env, runner, transport, refs)
            except Exception as e:
                env.result.setdefault("errors", {})[name] = (
                    f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
                )
                print(env.result["errors"][name], flush=True)
            env.save()
    except BaseException as e:
        env.result["fatal"] = f"{type(e).__name__}: {e}"
        env.result["traceback"] = traceback.format_exc()[-4000:]
        print(env.result["traceback"], flush=True)
    finally:
        env.result["elapsed_s"] = round(now() - t_start, 1)
        refs_obj = env.result.get("_refs")
        if refs_obj is not None:
            env.result["teacher_forced_checks"] = refs_obj.checks
        for k in [k for k in env.result if k.startswith("_")]:
            obj = env.result.pop(k)
            if isinstance(obj, asyncio.Task):
                obj.cancel()
            elif hasattr(obj, "close"):
                with contextlib.suppress(Exception):
                    obj.close()
        if refs_obj is not None:
            with contextlib.suppress(Exception):
                await refs_obj.client.aclose()
        env.save()
        await shutdown(env)
        for rid, rep in env.replicas.items():
            with contextlib.suppress(Exception):
                (Path(args.out).parent / f"server-{rid}.log").write_text(rep.log_tail(80))
    return env.result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":
        import json

        from bench.gpu_results import merge_waves

        m = argparse.ArgumentParser(prog="python -m bench.gpu_waves merge")
        m.add_argument("run", type=Path)
        m.add_argument(
            "--into", type=Path, default=Path(__file__).parent / "results" / "gpu_update.json"
        )
        ma = m.parse_args(argv[1:])
        ma.into.write_text(json.dumps(merge_waves(ma.run, ma.into), indent=1, default=str) + "\n")
        print(f"wrote {ma.into}")
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_waves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--phases", default="waves,rolling,tp2")
    ap.add_argument("--model", default="/tmp/models/qwen3-8b-shape")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_waves.json")
    )
    ap.add_argument("--work", default="/tmp/gpu-waves")
    ap.add_argument("--nccl-port", type=int, default=29555)
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--cuda-graphs", action="store_true", help="no --enforce-eager")
    ap.add_argument("--buffer-mb", type=int, default=1024)  # (nccl_config; unused by direct)
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--gather-s", type=float, default=5.0)
    ap.add_argument("--wave-receive-timeout-s", type=float, default=60.0)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per k (+1 warm-up)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rolls", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--tp-cycles", type=int, default=3)
    ap.add_argument("--tf-mean-tol", type=float, default=TF_MEAN_TOL)
    ap.add_argument("--tf-max-tol", type=float, default=TF_MAX_TOL)
    ap.add_argument("--budget-s", type=float, default=330.0, help="then only tp2 still runs")
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    args.extension = True
    args.enforce_eager = not args.cuda_graphs
    args.replica_gpu = "1"  # (replica_spec's default; every replica here sets its own)
    result = asyncio.run(amain(args))
    keys = ("start_s", "bootstrap", "elapsed_s", "fatal", "errors", "skipped")
    print({k: result.get(k) for k in keys}, flush=True)
    return 1 if "fatal" in result else 0


if __name__ == "__main__":
    sys.exit(main())
