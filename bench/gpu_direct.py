"""GPU weight path at the link's speed and checksum validation, 2x H200.

Runs on the GPU host (``tests/gpu/README.md``), never in CI. Trainer on GPU 0 (this process),
replicas on GPU 1 with RolloutPool's worker extension (``--worker-extension-cls
pool.replica_extension.WeightExtension``), CUDA graphs on as served, ``--load-format dummy``.
Builds on :mod:`bench.gpu_update` (trainer with seeded weights per generation, replicas, Redis
store, rollout load, rollout verification). Every cycle goes through the project's
:class:`~updater.cycle.CycleRunner` (fenced store transitions, deadlines) with a teacher-forced
log-prob validator (greedy probes are useless on random bf16 weights) that looks up the
*target* generation's reference log-probs, so the trainer may change its weights meanwhile.

Phases (``--phases``, in this order):

* ``kernels`` (no vLLM): the checksum of 16.4 GB of bf16 (Qwen3-8B shapes) by the fused Triton
  reduction vs the torch fallback (equal, and timed), and the staging copy (D2D) alone;
* ``raw``: raw NCCL broadcast GPU0 -> GPU1 (``bench.gpu.harness.phase_raw``);
* ``ab``: one replica; bootstrap over ``nccl_direct``; then ``--cycles`` full update cycles
  alternating ``nccl_direct`` and ``nccl`` (vLLM's own path, one warm-up first), per-step
  breakdown of each;
* ``staging``: the trainer hands one copy (``StagedSource.stage``) and moves its own weights on
  at once; every replica is rolled from the copy: trainer stall vs in-process sending, with 1
  and then 2 replicas (the second replica starts here);
* ``rolling``: rolling updates under load over ``nccl_direct`` (two replicas), every rollout
  verified against its bound generation (0 cross-generation expected);
* ``negative``: one bit flipped on the wire into r1, and a transfer cut after 90 % of the
  tensors into r0: both must end TAINTED by checksum validation, never published;
* ``restart``: restart-to-serving of r1 and its recovery over ``nccl_direct``.

Writes ``--out`` after every step (a crash keeps what was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Any

from bench.gpu.cycles import (
    Refs,
    make_runner,
    new_generation,
    now,
    run_cycle,
)
from bench.gpu.harness import (
    TF_MAX_TOL,
    TF_MEAN_TOL,
    Env,
    Load,
    gen,
    gpu_info,
    identity,
    nccl_config,
    phase_raw,
    record_pids,
    shutdown,
    start_pool,
    start_replica,
    start_replicas_with_trainer,
    target,
    verify_rollouts,
)
from pool.types import TensorSpec
from testkit.stats import med

GIB = 1024**3


# ------------------------------------------------------------------------------ validation


# ------------------------------------------------------------------------------ phases


def phase_kernels(env: Env) -> None:
    from bench.gpu_kernels import measure

    env.result["kernels"] = measure()
    print(f"kernels: {env.result['kernels']}", flush=True)


async def phase_ab(env: Env, refs: Refs) -> None:
    from updater.transports.nccl import ModuleSource, NcclTransport
    from updater.transports.nccl.direct import NcclDirectTransport

    a, res = env.args, env.result
    starts = await start_replicas_with_trainer(env, ["r0"])
    res["cold_start_s"] = round(starts["r0"], 1)
    if a.replicas > 1:  # before any transfer: the replicas share GPU 1, profiled one by one
        try:
            res["r1_start_s"] = round(await start_replica(env, "r1"), 1)
        except Exception as e:
            res["r1_start_error"] = f"{type(e).__name__}: {e}"[:3000]
    trainer = env.trainer
    assert trainer is not None
    refs.trainer = trainer
    src = ModuleSource(trainer.model)
    direct = NcclDirectTransport(nccl_config(env, master_port=a.nccl_port), src)
    vllm = NcclTransport(nccl_config(env, master_port=a.nccl_port + 10), src)
    env.result["_direct"], env.result["_vllm"] = direct, vllm
    r_direct, r_vllm = make_runner(env, direct, refs), make_runner(env, vllm, refs)
    env.result["_r_direct"] = r_direct
    h = env.handles["r0"]
    new_generation(env, refs, 0)
    dummy = await refs.check(h.engine.url, 0, "dummy")  # dummy weights vs g0: no match
    t0 = now()  # bootstrap over vLLM's own path (known to work), which also warms its group
    boot_runner, boot_t = (r_direct, direct) if a.direct_only else (r_vllm, vllm)
    boot = await boot_runner.bootstrap(
        h, gen(0), identity(env, 0), target(env, 0).probe, checkpoint=Path("/in-process/g0")
    )
    res["bootstrap"] = {
        "report": boot.model_dump(mode="json"),
        "wall_s": round(now() - t0, 3),
        "transfer": boot_t.last.get(h.engine.url),
        "dummy_vs_g0": dummy,
    }
    print(f"bootstrap: {res['bootstrap']}", flush=True)
    env.save()
    g = 1
    new_generation(env, refs, g)  # first direct cycle: its group init, Triton compiles
    warm = await run_cycle(env, r_direct, direct, "r0", g)
    warm["check"] = refs.checks[-1] if refs.checks else None
    print(f"ab warm-up nccl_direct g{g}: {warm}", flush=True)
    paths = ["nccl_direct"] if a.direct_only else ["nccl_direct", "nccl"]
    if warm.get("outcome") != "ready" and not a.direct_only:  # measure vLLM's path alone
        res["direct_failed"] = warm
        with contextlib.suppress(Exception):
            res["direct_failed"]["server_log"] = env.replicas["r0"].log_tail(60)
        await r_vllm.start_recovery(h, "nccl_direct failed")
        await env.replicas["r0"].restart()
        vllm.forget(h.engine.url)
        g -= 1
        new_generation(env, refs, g)
        await r_vllm.bootstrap(h, gen(g), identity(env, g), target(env, g).probe, Path("/x"))
        paths = ["nccl"]
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    for i in range(len(paths) * a.cycles):
        g += 1
        new_generation(env, refs, g)
        name = paths[i % len(paths)]
        runner, transport = (r_vllm, vllm) if name == "nccl" else (r_direct, direct)
        row = await run_cycle(env, runner, transport, "r0", g)
        row["check"] = refs.checks[-1] if refs.checks else None
        rows[name].append(row)
        print(
            f"ab {name} g{g}: window {row.get('window_s')} phases {row.get('phases')} "
            f"transfer {row.get('transfer', {}).get('transfer_s')}",
            flush=True,
        )
    res["ab"] = {
        "warmup_nccl_direct": warm,
        **rows,
        "summary": {n: summarize(r) for n, r in rows.items()},
    }
    res["g_latest"] = g
    env.save()
    if "nccl_direct" not in paths:
        raise RuntimeError("nccl_direct failed: the phases after ab need it")
    if "r1" in env.handles:  # r1 joins on the current generation, over nccl_direct
        t0 = now()
        boot = await r_direct.bootstrap(
            env.handles["r1"], gen(g), identity(env, g), target(env, g).probe, Path(f"/x/g{g}")
        )
        res["r1_bootstrap"] = {"report": boot.model_dump(mode="json"), "wall_s": now() - t0}
        env.save()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("outcome") == "ready"]
    t = [r["transfer"] for r in ok]
    nbytes = t[0]["bytes"] if t else 0
    out: dict[str, Any] = {
        "cycles": len(rows),
        "ready": len(ok),
        "checks_ok": sum(1 for r in ok if (r.get("check") or {}).get("ok")),
        "transfer_s": med([x["transfer_s"] for x in t]),
        "window_s": med([r["window_s"] for r in ok]),
    }
    if out["transfer_s"]:
        out["transfer_GBps"] = round(nbytes / out["transfer_s"] / 1e9, 1)
    for phase in ("transfer", "invalidate", "checksum", "validate", "resume"):
        vals = [r["phases"][phase] for r in ok if phase in r["phases"]]
        if vals:
            out[f"phase_{phase}_s"] = med(vals)
    for key in ("start_s", "update_http_s", "finish_s", "send_s", "send_enqueue_s", "checksum_s"):
        vals = [x[key] for x in t if key in x]
        if vals:
            out[key] = med(vals)
    recv = [x["receive"]["receive_s"] for x in t if isinstance(x.get("receive"), dict)]
    if recv:
        out["replica_receive_s"] = med(recv)
        out["replica_receive_GBps"] = round(nbytes / statistics.median(recv) / 1e9, 1)
    return out


async def roll(env: Env, runner: Any, transport: Any, rids: list[str], g: int) -> list[Any]:
    return [await run_cycle(env, runner, transport, rid, g) for rid in rids]


async def phase_staging(env: Env, refs: Refs) -> None:
    """Trainer stall per update: staging (one D2D copy, the trainer moves on at once) vs
    in-process sending (the trainer's weights are read until the last replica got them)."""
    from updater.transports.nccl import StagedSource
    from updater.transports.nccl.direct import NcclDirectTransport

    a, res = env.args, env.result
    trainer = env.trainer
    assert trainer is not None
    direct, r_direct = res["_direct"], res["_r_direct"]
    staged = StagedSource()
    s_transport = NcclDirectTransport(nccl_config(env, master_port=a.nccl_port + 20), staged)
    res["_staged"] = s_transport
    s_runner = make_runner(env, s_transport, refs)
    out: dict[str, Any] = res.setdefault("staging", {})
    g = res["g_latest"]
    for n in (1, 2):
        rids = ["r0", "r1"][:n]
        if n > len(env.handles):
            break
        staged_rows, inproc_rows = [], []
        for _ in range(a.stage_reps):
            g += 1
            new_generation(env, refs, g)
            stall = staged.stage(trainer.model)
            trainer.set_generation(g + 100_000)  # the trainer trains on; the copy is g
            t0 = now()
            cycles = await roll(env, s_runner, s_transport, rids, g)
            staged_rows.append(
                {
                    "generation": g,
                    "trainer_stall_s": round(stall, 4),
                    "roll_s": round(now() - t0, 3),
                    "cycles": cycles,
                }
            )
            res["g_latest"] = g
            g += 1
            new_generation(env, refs, g)
            t0 = now()  # in process: the trainer may not touch its weights until the roll ends
            cycles = await roll(env, r_direct, direct, rids, g)
            inproc_rows.append(
                {"generation": g, "trainer_stall_s": round(now() - t0, 4), "cycles": cycles}
            )
            res["g_latest"] = g
        out[f"n{n}"] = {
            "replicas": n,
            "staged": staged_rows,
            "in_process": inproc_rows,
            "staged_stall_s": med([r["trainer_stall_s"] for r in staged_rows]),
            "in_process_stall_s": med([r["trainer_stall_s"] for r in inproc_rows]),
            "all_ready": all(
                c.get("outcome") == "ready" for r in staged_rows + inproc_rows for c in r["cycles"]
            ),
        }
        print(
            f"staging n={n}: { ({k: v for k, v in out[f'n{n}'].items() if 'stall' in k}) }",
            flush=True,
        )
        env.save()
    res["g_latest"] = g


async def phase_rolling(env: Env, refs: Refs) -> None:
    a, res = env.args, env.result
    direct, r_direct = res["_direct"], res["_r_direct"]
    rids = ["r0", "r1"]
    g0 = res["g_latest"]
    load = Load(env, rids)
    load.start(a.workers)
    await asyncio.sleep(a.settle_s)
    updates = []
    g = g0
    for _ in range(a.rolls):
        g += 1
        new_generation(env, refs, g)
        for row in await roll(env, r_direct, direct, rids, g):
            updates.append(row)
            await asyncio.sleep(a.settle_s)
        res["g_latest"] = g
    await asyncio.sleep(a.settle_s)
    await load.finish()
    res["g_latest"] = g
    ver = await verify_rollouts(env, load.records, list(range(g0 - 1, g + 1)))
    res["rolling"] = {
        "replicas": 2,
        "transport": "nccl_direct",
        "updates": sum(u.get("outcome") == "ready" for u in updates),
        "rollouts": ver["rollouts"],
        "cross_generation": ver["cross_generation"],
        "verification": ver,
        "windows_s": [u.get("window_s") for u in updates],
        "admission_refused": load.refused,
        "errors": len(load.errors),
        "error_examples": load.errors[:5],
        "workers": a.workers,
    }
    print(f"rolling: {res['rolling']}", flush=True)
    env.save()


class FlipOneBit:
    """Wraps the sender's communicator: broadcast number ``at`` sends a copy of its tensor with
    one bit flipped (made on the broadcast's stream), as a corrupting link would."""

    def __init__(self, group: Any, at: int) -> None:
        self.group, self.at, self.n = group, at, 0
        self.keep: list[Any] = []

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        import torch

        if self.n == self.at:
            with torch.cuda.stream(stream or torch.cuda.current_stream()):
                tensor = tensor.clone()
                words = tensor.view(torch.int16).view(-1)
                words[123] ^= 1
            self.keep.append(tensor)
        self.n += 1
        self.group.broadcast(tensor, src=src, stream=stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


async def phase_negative(env: Env, refs: Refs) -> None:
    from updater.transports.nccl import ModuleSource
    from updater.transports.nccl.direct import NcclDirectTransport

    class CutTransport(NcclDirectTransport):
        def _plan(self, specs: list[TensorSpec]) -> list[TensorSpec]:
            return specs[: len(specs) * 9 // 10]

    a, res = env.args, env.result
    trainer = env.trainer
    assert trainer is not None
    direct, r_direct = res["_direct"], res["_r_direct"]
    out: dict[str, Any] = res.setdefault("negative_controls", {})
    latest_before = (await env.store.latest())[0].number
    g = res["g_latest"]

    g += 1
    new_generation(env, refs, g)
    h1 = env.handles["r1"]
    rep = direct._replicas[h1.engine.url.rstrip("/")]
    names = [s.name for s in ModuleSource(trainer.model).specs()]
    at = names.index("model.layers.17.self_attn.k_proj.weight")
    core = direct.sender.core
    core.groups[rep.group.key] = FlipOneBit(core.groups[rep.group.key], at)
    flip = await run_cycle(env, r_direct, direct, "r1", g)
    core.groups[rep.group.key] = core.groups[rep.group.key].group
    flip["store_state"] = (await env.store.replica("r1")).state.value
    out["flip_one_bit"] = flip

    cut_t = CutTransport(
        nccl_config(env, master_port=a.nccl_port + 30), ModuleSource(trainer.model)
    )
    res["_cut"] = cut_t
    cut = await run_cycle(env, make_runner(env, cut_t, refs), cut_t, "r0", g)
    cut["store_state"] = (await env.store.replica("r0")).state.value
    out["cut_after_90_percent"] = cut
    out["latest_before"] = latest_before
    out["latest_after"] = (await env.store.latest())[0].number
    out["never_published"] = out["latest_after"] == latest_before
    res["g_latest"] = g
    print(f"negative: {out}", flush=True)
    env.save()


async def phase_restart(env: Env, refs: Refs) -> None:
    """Restart-to-serving of the last replica started, then its recovery over nccl_direct."""
    res = env.result
    direct, r_direct = res["_direct"], res["_r_direct"]
    rid = sorted(env.handles)[-1]
    h = env.handles[rid]
    g = res["g_latest"] - 1 if res.get("negative_controls") else res["g_latest"]
    new_generation(env, refs, g)
    if (await env.store.replica(rid)).state.value != "TAINTED":
        await r_direct._taint(h, "planned restart", RuntimeError("restart measurement"))
    await r_direct.start_recovery(h, "restart measurement")
    t0 = now()
    await env.replicas[rid].stop()
    stop_s = now() - t0
    env.replicas[rid]._proc = None
    start_s = await env.replicas[rid].start()
    direct.forget(h.engine.url)
    boot = await r_direct.bootstrap(
        h, gen(g), identity(env, g), target(env, g).probe, checkpoint=Path(f"/x/g{g}")
    )
    windows = [r["window_s"] for r in res.get("ab", {}).get("nccl_direct", []) if r.get("window_s")]
    res["restart"] = {
        "replica": rid,
        "stop_s": round(stop_s, 2),
        "start_to_serving_s": round(start_s, 2),
        "recovery": boot.model_dump(mode="json"),
        "restart_over_hot": round(start_s / statistics.median(windows), 1) if windows else None,
    }
    print(f"restart: {res['restart']}", flush=True)
    env.save()


# ------------------------------------------------------------------------------ main

QWEN3_32B = {  # Qwen3-32B's published shapes (65.5 GB in bf16)
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def ensure_model_dir(path: Path) -> None:
    """``qwen3-32b-shape``: the bundle's 8B-shape directory (tokenizer, config) with the
    32B shapes written into its config; other models must exist already."""
    if path.name != "qwen3-32b-shape":
        return
    import shutil

    shutil.copytree(path.parent / "qwen3-8b-shape", path, dirs_exist_ok=True)
    cfg = json.loads((path.parent / "qwen3-8b-shape" / "config.json").read_text())
    cfg.update(QWEN3_32B)
    n = QWEN3_32B["num_hidden_layers"]
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [cfg["layer_types"][0]] * n
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = n
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    os.makedirs(work, exist_ok=True)
    ensure_model_dir(Path(args.model))
    env = Env(
        args,
        {"phases": args.phases, "model": args.model, "gpu": gpu_info(), "argv": sys.argv},
        work,
    )
    with contextlib.suppress(Exception):
        from updater.transports.nccl import local_vllm_version

        env.result["vllm_version"] = local_vllm_version()
    refs: Refs | None = None
    t_start = now()
    try:
        if "kernels" in args.phases:
            await asyncio.to_thread(phase_kernels, env)
            env.save()
        if "raw" in args.phases:
            await asyncio.to_thread(phase_raw, env)
            env.save()
        if "ab" in args.phases:
            env.result["_pids"] = asyncio.create_task(record_pids(env))
            await start_pool(env)
            refs = Refs(None)  # type: ignore[arg-type]  # the trainer is built in phase ab
            refs.mean_tol, refs.max_tol = args.tf_mean_tol, args.tf_max_tol
            await phase_ab(env, refs)
            for name, fn in (
                ("staging", phase_staging),
                ("rolling", phase_rolling),
                ("negative", phase_negative),
                ("restart", phase_restart),
            ):
                if name not in args.phases:
                    continue
                if now() - t_start > args.budget_s:
                    env.result.setdefault("skipped", []).append(f"{name}: over --budget-s")
                    continue
                try:
                    await fn(env, refs)
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
        for k in [k for k in env.result if k.startswith("_")]:
            obj = env.result.pop(k)
            if isinstance(obj, asyncio.Task):
                obj.cancel()
            elif hasattr(obj, "close"):
                with contextlib.suppress(Exception):
                    obj.close()
        if refs is not None:
            env.result["teacher_forced_checks"] = refs.checks
            with contextlib.suppress(Exception):
                await refs.client.aclose()
        env.save()
        await shutdown(env)
        for rid, rep in env.replicas.items():
            with contextlib.suppress(Exception):
                (Path(args.out).parent / f"server-{rid}.log").write_text(rep.log_tail(80))
    return env.result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":
        m = argparse.ArgumentParser(prog="python -m bench.gpu_direct merge")
        m.add_argument("kernels", type=Path)
        m.add_argument("run8b", type=Path)
        m.add_argument("--run32b", type=Path)
        m.add_argument("--first8b", type=Path)
        m.add_argument(
            "--out", type=Path, default=Path(__file__).parent / "results" / "gpu_update.json"
        )
        m.add_argument("--command", default="")
        m.add_argument("--note", action="append", default=[])
        ma = m.parse_args(argv[1:])
        from bench.gpu_results import merge

        res = merge(ma.kernels, ma.run8b, ma.run32b, ma.first8b, ma.out)
        res["command"], res["notes"] = ma.command, ma.note
        ma.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {ma.out}")
        return 0
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_direct",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--phases", default="raw,ab,staging,rolling,negative,restart")
    ap.add_argument("--model", default="/tmp/models/qwen3-8b-shape")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_direct.json")
    )
    ap.add_argument("--work", default="/tmp/gpu-bench")
    ap.add_argument("--nccl-bw", default="/tmp/stage/nccl_bw.py")
    ap.add_argument("--nccl-port", type=int, default=29555)
    ap.add_argument("--replica-gpu", default="1")
    ap.add_argument("--gpu-util", type=float, default=0.3)
    ap.add_argument("--replicas", type=int, default=2, choices=(1, 2))
    ap.add_argument("--tf-mean-tol", type=float, default=TF_MEAN_TOL)
    ap.add_argument("--tf-max-tol", type=float, default=TF_MAX_TOL)
    ap.add_argument(
        "--direct-only", action="store_true", help="no vLLM-path cycles (bootstrap over direct)"
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--buffer-mb", type=int, default=1024)
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=5, help="cycles per path in phase ab")
    ap.add_argument("--stage-reps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rolls", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="skip the remaining phases once this much time has passed",
    )
    args = ap.parse_args(argv)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    args.extension = True
    result = asyncio.run(amain(args))
    keys = ("kernels", "raw_nccl_GBps", "cold_start_s", "elapsed_s", "fatal", "errors")
    print(json.dumps({k: result.get(k) for k in keys}, default=str)[:3000], flush=True)
    return 1 if "fatal" in result else 0


if __name__ == "__main__":
    sys.exit(main())
