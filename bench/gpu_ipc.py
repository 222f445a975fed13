"""``ipc_direct`` and vLLM's ``ipc`` on one H200: trainer and 2 replicas on the same GPU.

Runs on the GPU host (``tests/gpu/README.md``), never in CI. This process is the trainer
(:class:`bench.gpu_update.Trainer`, the Qwen3-8B shape, seeded weights per generation) and owns
the staging buffer (:class:`~updater.transports.ipc.IpcStaging`, one slot); two ``vllm serve``
replicas share GPU 0 with it (``--gpu-memory-utilization`` ``--gpu-util`` each, started one
after the other before the trainer allocates), with RolloutPool's worker extension and vLLM's
``ipc`` weight-transfer backend. Every cycle goes through :class:`~updater.cycle.CycleRunner`
(Redis store, fenced transitions, deadlines) with the teacher-forced validator of
:mod:`bench.gpu_direct` after the checksum comparison.

Per generation the trainer stages its weights (the stall: one device-to-device copy), keyed
by the generation's identity, and the replica copies them over CUDA IPC.

Phases, in order: ``start`` (replicas, trainer, bootstrap of both over ``ipc_direct``), ``ab``
(one warm-up, then ``--cycles`` cycles over ``ipc_direct`` and ``--vllm-cycles`` over vLLM's
``ipc``, on r0), ``breakdown`` (r0 paused re-copies the staged copy it serves, without and
with checksums: the copy alone, the checksums, the RPC round trip), ``restart`` (r1 restarted
and recovered from the staged copy), ``rolling``
(rolling updates under load over both replicas, every rollout
verified against its bound generation), ``negative`` (a bit flipped in the staged copy after the
sender checksummed it, into r1; a copy cut after 90 % of the tensors, into r0: both must be
TAINTED, never published).

vLLM 0.26's ``ipc_engine`` module imports ``ray`` at load (only its trainer's ray send mode
uses it) and the host has no ray: the replicas get an empty ``ray`` package on their path
(``<work>/shim``). ``python -m bench.gpu_ipc merge ipc.json`` adds the result to
``bench/results/gpu_update.json`` (``paths.ipc_direct``, ``paths.ipc``,
``negative_controls_ipc``; everything else kept).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.gpu.cycles import Refs, make_runner, new_generation, run_cycle
from bench.gpu.harness import (
    RESULTS,
    Env,
    Load,
    build_trainer,
    gen,
    gpu_info,
    identity,
    record_pids,
    replica_spec,
    shutdown,
    start_pool,
    target,
    verify_rollouts,
)
from testkit.stats import med
from updater.transports.ipc import IpcDirectTransport, IpcStaging, VllmIpcTransport

FLIPPED = "model.layers.17.self_attn.k_proj.weight"
GOALS = {"transfer_GBps": 1200.0, "window_s": 0.06, "restart_over_hot": 750.0}


def now() -> float:
    return time.monotonic()


# ------------------------------------------------------------------------------ setup


def ipc_spec(env: Env, rid: str) -> Any:
    """The replica of :func:`bench.gpu_update.replica_spec` with vLLM's ``ipc`` backend."""
    shim = env.work / "shim"
    (shim / "ray").mkdir(parents=True, exist_ok=True)
    (shim / "ray" / "__init__.py").write_text(
        '"""Empty: vLLM 0.26 ipc_engine imports ray at load; its ray send mode is unused."""\n'
    )
    spec = replica_spec(env, rid)
    path = f"{shim}:{os.environ.get('PYTHONPATH', '')}"
    extra_env = {"PYTHONPATH": path, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    return spec.model_copy(
        update={"weight_transfer_backend": "ipc", "env": {**spec.env, **extra_env}}
    )


async def start(env: Env) -> None:
    """Both replicas (one after the other, before the trainer allocates), then the trainer,
    then register them."""
    from pool.engine import VllmEngine
    from pool.launcher import LocalReplica
    from updater.cycle import ReplicaHandle

    res = env.result
    for rid in ("r0", "r1"):
        rep = LocalReplica(ipc_spec(env, rid))
        env.replicas[rid] = rep
        res.setdefault("start_s", {})[rid] = round(await rep.start(), 1)
        print(f"[{rid}] serving after {res['start_s'][rid]} s", flush=True)
    await build_trainer(env)
    assert env.manifest is not None
    for rid, rep in env.replicas.items():
        engine = VllmEngine(rep.url, timeout=60.0)
        await engine.bootstrap()
        env.handles[rid] = ReplicaHandle(rid, engine, env.manifest)
        await env.store.register_replica(rid, rep.url, env.lease.require())
    res["vllm_version"] = env.handles["r0"].engine.capabilities.version


class Rig:
    """The trainer's staging, the two transports over it and their cycle runners."""

    def __init__(self, env: Env, refs: Refs) -> None:
        self.env, self.refs = env, refs
        self.staging = IpcStaging(slots=1)
        self.direct = IpcDirectTransport(self.staging)
        self.vllm = VllmIpcTransport(self.staging)
        self.r_direct = make_runner(env, self.direct, refs)
        self.r_vllm = make_runner(env, self.vllm, refs)
        self.stalls: list[float] = []

    def new(self, g: int) -> None:
        """The trainer moves to generation ``g`` and stages it (its stall is recorded)."""
        new_generation(self.env, self.refs, g)
        assert self.env.trainer is not None
        copy = self.staging.stage(self.env.trainer.model, key=identity(self.env, g).digest)
        self.stalls.append(copy.stall_s)

    async def bootstrap(self, rid: str, g: int) -> dict[str, Any]:
        h = self.env.handles[rid]
        t0 = now()
        boot = await self.r_direct.bootstrap(
            h, gen(g), identity(self.env, g), target(self.env, g).probe, Path(f"/mem/g{g}")
        )
        return {
            "report": boot.model_dump(mode="json"),
            "wall_s": round(now() - t0, 3),
            "transfer": self.direct.last.get(h.engine.url),
        }


#: The worker's timings of one ``rolloutpool_ipc_copy`` (:meth:`pool.ipc_copy.Prepared.run` and
#: :meth:`pool.replica_extension.WeightExtension.rolloutpool_ipc_copy`).
WORKER_KEYS = (
    "copies",
    "plan_s",
    "queue_s",
    "copy_gpu_s",
    "checksum_gpu_s",
    "run_s",
    "worker_s",
)


def _has_worker(transfer: dict[str, Any]) -> bool:
    recv = transfer.get("receive")
    return isinstance(recv, list) and bool(recv) and "worker_s" in recv[0]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the READY cycles of one path."""
    ok = [r for r in rows if r.get("outcome") == "ready"]
    t = [r["transfer"] for r in ok]
    out: dict[str, Any] = {
        "cycles": len(rows),
        "ready": len(ok),
        "checks_ok": sum(1 for r in ok if (r.get("check") or {}).get("ok")),
        "transfer_s": med([x["transfer_s"] for x in t]),
        "window_s": med([r["window_s"] for r in ok]),
        "windows_s": [r["window_s"] for r in ok],
    }
    if t and out["transfer_s"]:
        out["transfer_GBps"] = round(t[0]["bytes"] / out["transfer_s"] / 1e9, 1)
    for phase in ("transfer", "invalidate", "checksum", "validate", "resume"):
        vals = [r["phases"][phase] for r in ok if phase in r["phases"]]
        if vals:
            out[f"phase_{phase}_s"] = med(vals)
    recv = [x["receive"][0] for x in t if isinstance(x.get("receive"), list) and x["receive"]]
    for key in WORKER_KEYS:
        vals = [float(r[key]) for r in recv if key in r]
        if vals:
            out[f"replica_{key}"] = med(vals)
    overhead = [x["transfer_s"] - x["receive"][0]["worker_s"] for x in t if _has_worker(x)]
    if overhead:
        out["rpc_overhead_s"] = med(overhead)
    if recv and out.get("replica_copy_gpu_s"):
        out["replica_copy_GBps"] = round(t[0]["bytes"] / out["replica_copy_gpu_s"] / 1e9, 1)
    kernels = sorted({str(r["checksum_kernel"]) for r in recv if "checksum_kernel" in r})
    if kernels:
        out["replica_checksum_kernel"] = kernels
    for key in ("start_s", "update_s", "finish_s"):
        vals = [x[key] for x in t if key in x]
        if vals:
            out[key] = med(vals)
    return out


# ------------------------------------------------------------------------------ phases


async def phase_ab(env: Env, rig: Rig) -> None:
    a, res = env.args, env.result
    rig.new(0)
    res["bootstrap"] = {rid: await rig.bootstrap(rid, 0) for rid in ("r0", "r1")}
    print(f"bootstrap: {res['bootstrap']}", flush=True)
    g = 1
    rig.new(g)
    warm = await run_cycle(env, rig.r_direct, rig.direct, "r0", g)
    print(f"warm-up: {warm}", flush=True)
    rows: dict[str, list[dict[str, Any]]] = {"ipc_direct": [], "ipc": []}
    plan = ["ipc_direct"] * a.cycles + ["ipc"] * a.vllm_cycles
    for name in plan:
        g += 1
        rig.new(g)
        runner, transport = (
            (rig.r_direct, rig.direct) if name == "ipc_direct" else (rig.r_vllm, rig.vllm)
        )
        row = await run_cycle(env, runner, transport, "r0", g)
        row["check"] = rig.refs.checks[-1] if rig.refs.checks else None
        rows[name].append(row)
        print(f"{name} g{g}: {row.get('outcome')} window {row.get('window_s')}", flush=True)
        if row.get("outcome") != "ready":
            if name == "ipc":
                break  # vLLM's path failed: r0 is tainted; recover it over ipc_direct
            raise RuntimeError(f"ipc_direct cycle failed: {row}")
    if rows["ipc"] and rows["ipc"][-1].get("outcome") != "ready":
        res["ipc_failure_log"] = env.replicas["r0"].log_tail(40)
        await rig.r_direct.start_recovery(env.handles["r0"], "vLLM ipc path failed")
        await env.replicas["r0"].restart()
        rig.direct.forget(env.handles["r0"].engine.url)
        g += 1
        rig.new(g)
        res["r0_recovered"] = await rig.bootstrap("r0", g)
    g += 1
    rig.new(g)
    r1 = [await run_cycle(env, rig.r_direct, rig.direct, rid, g) for rid in ("r0", "r1")]
    res["ab"] = {
        "warmup_ipc_direct": warm,
        **rows,
        "both_to_latest": r1,
        "summary": {n: summary(r) for n, r in rows.items() if r},
    }
    res["trainer_stall_s"] = {"median": med(rig.stalls), "first": rig.stalls[0]}
    res["g_latest"] = g
    env.save()


async def phase_breakdown(env: Env, rig: Rig) -> None:
    """Where a transfer's time goes: r0 (paused, no load) copies the staged copy it already
    serves (the same bytes: its weights do not change) ``--breakdown-reps`` times each
    without and with the replica's checksums, alternating, by the same ``/collective_rpc``
    the transport sends; each row has the round trip seen here (``wall_s``), the worker's
    timings and ``rpc_overhead_s`` (``wall_s`` - ``worker_s``). With checksums, they must
    equal the sender's. ``rpc_floor_s``: the round trip of a read-only call with a small answer
    (``rolloutpool_ipc_check``) by the same path."""
    from pool.checksum import from_json

    res = env.result
    g = res["g_latest"]
    copy = rig.staging.find(identity(env, g).digest)
    assert copy is not None
    kwargs = {
        "buffer": json.dumps(rig.staging.handle(copy).to_json()),
        "entries": json.dumps([e.to_json() for e in copy.entries]),
        "tag": json.dumps(copy.tag),
    }
    want = rig.staging.checksums(copy)
    engine = env.handles["r0"].engine
    rows: dict[str, list[dict[str, Any]]] = {"copy_only": [], "with_checksums": []}
    floor: list[float] = []
    await engine.pause()
    try:
        for _ in range(env.args.breakdown_reps):
            for mode, rows_of in rows.items():
                sums = mode == "with_checksums"
                t0 = now()
                rpc = await engine.collective_rpc(
                    "rolloutpool_ipc_copy",
                    {**kwargs, "checksums": json.dumps(sums)},
                    timeout_s=60.0,
                )
                wall = now() - t0
                r = dict(rpc.results[0])
                got = r.pop("checksums", None)
                r.update(wall_s=wall, rpc_overhead_s=wall - float(r["worker_s"]))
                if sums:
                    r["equal_to_sender"] = got is not None and from_json(json.loads(got)) == want
                rows_of.append(r)
            t0 = now()  # the floor: a read-only call of the same path with a small answer
            await engine.collective_rpc(
                "rolloutpool_ipc_check",
                {"buffer": kwargs["buffer"], "tag": kwargs["tag"]},
                timeout_s=60.0,
            )
            floor.append(now() - t0)
    finally:
        await engine.resume()
    out: dict[str, Any] = {"replica": "r0", "generation": g, "bytes": copy.nbytes}
    for mode, rows_of in rows.items():
        keys = ("wall_s", "rpc_overhead_s", *WORKER_KEYS)
        m = {k: med([float(r[k]) for r in rows_of if k in r]) for k in keys}
        m["GBps_whole"] = round(copy.nbytes / m["wall_s"] / 1e9, 1) if m["wall_s"] else None
        gpu = m.get("copy_gpu_s")
        m["GBps_copy_gpu"] = round(copy.nbytes / gpu / 1e9, 1) if gpu else None
        m["reps"] = len(rows_of)
        out[mode] = {"median": m, "rows": rows_of}
    out["checksums_equal"] = all(r.get("equal_to_sender") for r in rows["with_checksums"])
    out["rpc_floor_s"] = med(floor)
    res["breakdown"] = out
    print(f"breakdown: { {k: v['median'] for k, v in out.items() if isinstance(v, dict)} }")
    env.save()


async def phase_rolling(env: Env, rig: Rig) -> None:
    a, res = env.args, env.result
    rids = ["r0", "r1"]
    g0 = res["g_latest"]
    load = Load(env, rids)
    load.start(a.workers)
    await asyncio.sleep(a.settle_s)
    updates: list[dict[str, Any]] = []
    g = g0
    for _ in range(a.rolls):
        g += 1
        rig.new(g)
        for rid in rids:
            updates.append(await run_cycle(env, rig.r_direct, rig.direct, rid, g))
            await asyncio.sleep(a.settle_s)
        res["g_latest"] = g
    await asyncio.sleep(a.settle_s)
    await load.finish()
    ver = await verify_rollouts(env, load.records, list(range(g0 - 1, g + 1)))
    res["rolling"] = {
        "replicas": 2,
        "transport": "ipc_direct",
        "same_gpu": True,
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


async def phase_negative(env: Env, rig: Rig) -> None:
    from pool.ipc_handles import Entry

    res = env.result
    latest_before = (await env.store.latest())[0].number
    g = res["g_latest"] + 1
    rig.new(g)
    staging = rig.staging
    flipped: list[tuple[Any, int]] = []

    class FlipOneBit(IpcDirectTransport):
        """One bit of one tensor flipped in the staged copy after the sender checksummed it
        (preflight), as a corrupting copy would; restored after the cycle."""

        def _send_entries(self, entries: list[Entry]) -> list[Entry]:
            e = next(x for x in entries if x.name == FLIPPED)
            copy = staging.find(identity(env, g).digest)
            assert copy is not None
            buf = staging.buffer(copy)
            buf[e.offset + 123] ^= 1
            flipped.append((buf, e.offset + 123))
            return entries

    class Cut(IpcDirectTransport):
        def _send_entries(self, entries: list[Entry]) -> list[Entry]:
            return entries[: len(entries) * 9 // 10]

    out: dict[str, Any] = res.setdefault("negative_controls", {})
    flip_t = FlipOneBit(staging)
    flip = await run_cycle(env, make_runner(env, flip_t, rig.refs), flip_t, "r1", g)
    for buf, at in flipped:
        buf[at] ^= 1
    flip["store_state"] = (await env.store.replica("r1")).state.value
    out["flip_one_bit"] = flip
    cut_t = Cut(staging)
    cut = await run_cycle(env, make_runner(env, cut_t, rig.refs), cut_t, "r0", g)
    cut["store_state"] = (await env.store.replica("r0")).state.value
    out["cut_transfer"] = cut
    out["latest_before"] = latest_before
    out["latest_after"] = (await env.store.latest())[0].number
    out["never_published"] = out["latest_after"] == latest_before
    print(f"negative: {out}", flush=True)
    env.save()


async def phase_restart(env: Env, rig: Rig) -> None:
    """r1 restarted (a fresh process) and recovered to the latest generation from the staged
    copy (the trainer stages that generation again: one slot)."""
    res = env.result
    rid = "r1"
    h = env.handles[rid]
    g = (await env.store.latest())[0].number
    rig.new(g)
    if (await env.store.replica(rid)).state.value != "TAINTED":
        await rig.r_direct._taint(h, "planned restart", RuntimeError("restart measurement"))
    await rig.r_direct.start_recovery(h, "restart measurement")
    t0 = now()
    await env.replicas[rid].stop()
    stop_s = now() - t0
    env.replicas[rid]._proc = None  # a stopped LocalReplica is started afresh
    start_s = await env.replicas[rid].start()
    rig.direct.forget(h.engine.url)
    boot = await rig.bootstrap(rid, g)
    windows = res["ab"]["summary"]["ipc_direct"]["windows_s"]
    res["restart"] = {
        "replica": rid,
        "stop_s": round(stop_s, 2),
        "start_to_serving_s": round(start_s, 2),
        "recovery": boot,
        "recovered_from": "staged copy (ipc_direct)",
        "restart_over_hot": round(start_s / statistics.median(windows), 1) if windows else None,
    }
    print(f"restart: {res['restart']}", flush=True)
    env.save()


# ------------------------------------------------------------------------------ main


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work)
    os.makedirs(work, exist_ok=True)
    env = Env(args, {"model": args.model, "gpu": gpu_info(), "argv": sys.argv}, work)
    t0 = now()
    refs: Refs | None = None
    try:
        env.result["_pids"] = asyncio.create_task(record_pids(env))
        await start_pool(env)
        await start(env)
        assert env.trainer is not None
        refs = Refs(env.trainer)
        refs.mean_tol, refs.max_tol = args.tf_mean_tol, args.tf_max_tol
        rig = Rig(env, refs)
        env.result["_rig_vllm"] = rig.vllm
        await phase_ab(env, rig)
        for name, fn in (
            ("breakdown", phase_breakdown),
            ("restart", phase_restart),
            ("rolling", phase_rolling),
            ("negative", phase_negative),
        ):
            if now() - t0 > args.budget_s:
                env.result.setdefault("skipped", []).append(f"{name}: over --budget-s")
                continue
            try:
                await fn(env, rig)
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
        env.result["elapsed_s"] = round(now() - t0, 1)
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


def _short(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("outcome", "store_state", "generation", "reason")}


def merge(run: Path, previous: Path, restart_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """``previous`` (``bench/results/gpu_update.json``) with this run added: ``paths.
    ipc_direct`` (with this run's ``breakdown`` medians; and ``paths.ipc``, vLLM's engine,
    where this run measured it: else the previous run that did stays under
    ``details.run_ipc_1gpu_vllm``), ``negative_controls_ipc``, ``goals_ipc``, the whole run
    under ``details.run_ipc_1gpu``; everything else kept. ``restart_run``: the restart of
    another run (``start_to_serving_s``, its own ``windows_s``, ``source``) where this one
    has none."""
    d = json.loads(run.read_text())
    out: dict[str, Any] = json.loads(previous.read_text())
    details = out.setdefault("details", {})
    old = details.get("run_ipc_1gpu")
    if "ipc" not in d["ab"]["summary"] and old and "ipc" in old.get("ab", {}).get("summary", {}):
        details["run_ipc_1gpu_vllm"] = old
    if d.get("restart"):
        details.pop("run_ipc_1gpu_restart", None)
    s = d["ab"]["summary"]
    direct = dict(s["ipc_direct"])
    restart = d.get("restart") or {}
    if not restart and restart_run is not None:
        w = statistics.median(restart_run["windows_s"])
        restart = {
            "start_to_serving_s": restart_run["start_to_serving_s"],
            "restart_over_hot": round(restart_run["start_to_serving_s"] / w, 1),
            "windows_median_s": round(w, 4),
            "source": restart_run["source"],
        }
        out.setdefault("details", {})["run_ipc_1gpu_restart"] = restart_run
    rolling = d.get("rolling", {})
    direct.update(
        restart_s=restart.get("start_to_serving_s"),
        restart_over_hot=restart.get("restart_over_hot"),
        restart_source=restart.get("source", "this run"),
        cross_generation=rolling.get("cross_generation"),
        same_gpu=True,
        trainer_stall_s=d.get("trainer_stall_s"),
        vllm_version=d.get("vllm_version"),
        gpu=d.get("gpu"),
    )
    if d.get("breakdown"):
        b = d["breakdown"]
        direct["breakdown"] = {
            "copy_only": b["copy_only"]["median"],
            "with_checksums": b["with_checksums"]["median"],
            "checksums_equal": b["checksums_equal"],
        }
    out.setdefault("paths", {})["ipc_direct"] = direct
    if "ipc" in s:
        out["paths"]["ipc"] = s["ipc"]
    neg = d.get("negative_controls", {})
    out["negative_controls_ipc"] = {
        "flip_one_bit": _short(neg.get("flip_one_bit", {})),
        "cut_transfer": _short(neg.get("cut_transfer", {})),
        "never_published": neg.get("never_published"),
    }
    windows = direct.get("windows_s") or []
    out["goals_ipc"] = {
        "targets": GOALS,
        "met": {
            "transfer_GBps": (direct.get("transfer_GBps") or 0) >= GOALS["transfer_GBps"],
            "window_s": bool(windows) and statistics.median(windows) <= GOALS["window_s"],
            "restart_over_hot": (direct.get("restart_over_hot") or 0) >= GOALS["restart_over_hot"],
            "cross_generation_zero": rolling.get("cross_generation") == 0,
        },
    }
    out.setdefault("details", {})["run_ipc_1gpu"] = d
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":
        m = argparse.ArgumentParser(prog="python -m bench.gpu_ipc merge")
        m.add_argument("run", type=Path)
        m.add_argument("--out", type=Path, default=RESULTS / "gpu_update.json")
        m.add_argument("--restart-run", type=Path, help="JSON: a restart of another run")
        m.add_argument("--note", action="append", default=[], help="replaces notes_ipc")
        ma = m.parse_args(argv[1:])
        extra = json.loads(ma.restart_run.read_text()) if ma.restart_run else None
        res = merge(ma.run, ma.out, extra)
        res["notes_ipc"] = ma.note  # the previous run's notes are about the previous run
        ma.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {ma.out}")
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_ipc", description=__doc__)
    ap.add_argument("--model", default="/tmp/models/qwen3-8b-shape")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "ipc.json"))
    ap.add_argument("--work", default="/tmp/gpu-ipc")
    ap.add_argument("--replica-gpu", default="0")
    ap.add_argument("--gpu-util", type=float, default=0.28)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tf-mean-tol", type=float, default=0.10)
    ap.add_argument("--tf-max-tol", type=float, default=0.75)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--vllm-cycles", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rolls", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--breakdown-reps", type=int, default=4)
    args = ap.parse_args(argv)
    args.extension = True
    result = asyncio.run(amain(args))
    keys = ("start_s", "trainer_stall_s", "elapsed_s", "fatal", "errors")
    print(json.dumps({k: result.get(k) for k in keys}, default=str)[:3000], flush=True)
    return 1 if "fatal" in result else 0


if __name__ == "__main__":
    sys.exit(main())
