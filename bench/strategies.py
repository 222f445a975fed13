"""How each way of updating the rollout engines costs an asynchronous RL loop: stop-the-world,
keep, abort + resubmit (vLLM's native endpoints, driven directly on the replicas), and the pool
strict and at ``max_staleness`` 1, on the same running replicas, interleaved.

    flock /work/heavy.lock .venv/bin/python -m bench.strategies [--runs cpu_real,standin_8,...]
        [--short] [--rounds R]
    source tests/gpu/gpu_env.sh && python -m bench.strategies --runs gpu --keep   # GPU host

On the GPU host, runs may go side by side, each into its own results directory seeded with
this file (its ``calibration`` is the stand-ins' time model), and come back by ``--merge``::

    mkdir -p $OUT/s64 && cp bench/results/strategies.json $OUT/s64/
    ROLLOUTPOOL_RESULTS=$OUT/s64 python -m bench.strategies --runs standin_64:1 --no-figure
    python -m bench.strategies --merge .../s64/strategies.json ...   # here: replaces those runs

Runs (each: the replicas started once, then ``rounds`` rounds of the five strategies, the order
rotated every round so machine noise hits all alike; a strategy's row sums its segments):

* ``cpu_real``: 2 real vLLM CPU replicas (``testkit.harness.start_replicas``) serving the
  EOS-marker checkpoints (:mod:`testkit.scenarios.strategies.models`); before its rounds, a
  calibration: one request alone (``request_tokens_per_s``), the steady per-replica rate under
  the workload (``replica_tokens_per_s``) and ``reload_weights`` seconds (``transfer_s``);
* ``gpu`` (on the GPU host, ``tests/gpu/README.md``): 2 real vLLM 0.26 replicas sharing GPU 0
  (:func:`gpu_spec`, started one after the other), the same checkpoints, the same calibration
  (recorded in its ``params``, not used by the stand-ins); 0.26 reports no ``weight_versions``
  spans, so the baselines' tokens are attributed by their markers
  (:func:`testkit.scenarios.strategies.workload.pieces_of_markers`);
* ``standin_<N>``: N stand-in replicas (``python -m testkit.standin``) whose time model is that
  calibration (this run's ``cpu_real``, else the last one in the results file, else defaults),
  slowed by ``--dilate`` at large N so that one client process and one router on the 2-core box
  keep up (rates divided, transfer and train seconds multiplied: the same shape, longer).

The workload and every definition: :mod:`testkit.scenarios.strategies` (``workload``,
``report``). Writes ``bench/results/strategies.json`` after every run (``runs``: run ->
strategy -> row; ``ratios`` and ``goals`` over the runs; ``params`` per run;
``calibration``) and ``bench/results/strategies.png`` (the lanes and the table of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from bench._meta import RESULTS, meta, write
from pool.launcher import LocalReplica, ReplicaSpec
from testkit.harness import start_replicas, stop_replicas
from testkit.procs import terminate
from testkit.scenarios.scale import _spawn
from testkit.scenarios.strategies.drivers import prepare_replicas
from testkit.scenarios.strategies.models import MARKERS, eos_marker
from testkit.scenarios.strategies.report import STRATEGIES, figure, goals, ratios, row
from testkit.scenarios.strategies.segment import Params, Segment, run_segment, served_model

NAME = "strategies"
#: the runs on real vLLM replicas (2 each)
REAL = ("cpu_real", "gpu")
#: a stand-in time model for when no real calibration exists (2-core box, earlier runs)
DEFAULT_CALIBRATION = {"request_tokens_per_s": 120.0, "replica_tokens_per_s": 300.0,
                       "transfer_s": 0.3}  # fmt: skip


def params_for(run: str, short: bool, dilate: float) -> Params:
    """The workload of ``run``: 8 samples in flight per replica (4 at N >= 32), a batch of one
    sample per client, 3 steps a segment (2 when ``short``)."""
    n = 2 if run in REAL else int(run.split("_")[1])
    per = 8 if n < 32 else 4
    p = Params(concurrency=per * n, batch=per * n, steps=2 if short else 3)
    p.train_s = 3.0 * dilate
    p.warmup_s = (4.0 if short else 8.0) * dilate
    p.metrics_every_s = 0.5 if n <= 8 else 1.0
    return p


async def calibrate(urls: list[str], p: Params) -> dict[str, float]:
    """One request alone (tokens/s), ``reload_weights`` seconds, on the real replicas."""
    from pool.engine import VllmEngine

    async with aiohttp.ClientSession() as http:
        model = await served_model(http, urls[0])
        body = {"model": model, "token_ids": list(range(10, 26)),
                "sampling_params": {"max_tokens": p.max_tokens, "temperature": 1.0,
                                    "ignore_eos": True, "output_kind": 2}}  # fmt: skip
        rates = []
        for _ in range(3):
            t0 = time.monotonic()
            async with http.post(urls[0] + "/inference/v1/generate", json=body) as r:
                data = await r.json()
            rates.append(len(data["choices"][0]["token_ids"]) / (time.monotonic() - t0))
    async with VllmEngine(urls[0], timeout=120) as e:
        await e.bootstrap()
        path = str(eos_marker(1, p.eos_prob))
        await e.pause("wait")
        rpc = await e.collective_rpc("reload_weights", {"weights_path": path}, timeout_s=120)
        await e.resume()
    return {"request_tokens_per_s": round(max(rates), 1), "transfer_s": round(rpc.elapsed_s, 3)}


async def rounds(
    run: str,
    urls: list[str],
    p: Params,
    n_rounds: int,
    work: Path,
    on_round: Callable[[dict[str, list[Segment]]], Awaitable[None]],
) -> dict[str, list[Segment]]:
    segs: dict[str, list[Segment]] = {s: [] for s in STRATEGIES}
    for r in range(n_rounds):
        order = STRATEGIES[r % len(STRATEGIES) :] + STRATEGIES[: r % len(STRATEGIES)]
        for strategy in order:
            t = time.monotonic()
            # a fresh directory (so a fresh Redis) per run and segment
            seg = await run_segment(
                strategy, urls, p, work / run, seed=r * 10 + len(segs[strategy])
            )
            segs[strategy].append(seg)
            print(f"[{run}] round {r} {strategy}: {time.monotonic() - t:.0f} s, "
                  f"{len(seg.book.samples)} samples, waits {seg.book.waits} {seg.error}",
                  flush=True)  # fmt: skip
            await on_round(segs)  # after every segment: a run cut short keeps what it has
    return segs


class Results:
    """The results document, rewritten after every segment (a cut-off run keeps what it has)."""

    def __init__(self, path: Path, keep_old: bool, draw: bool = True) -> None:
        old = json.loads(path.read_text()) if path.exists() else {}
        self.doc: dict[str, Any] = {"runs": {}, "params": {}, "calibration": {}}
        if keep_old:
            for k in ("runs", "params", "calibration"):
                self.doc[k] = dict(old.get(k, {}))
        self.old_calibration: dict[str, float] = dict(old.get("calibration", {}))
        self.draw = draw

    def put(self, run: str, segs: dict[str, list[Segment]], extra: dict[str, Any]) -> None:
        self.set_run(run, {s: row(v) for s, v in segs.items() if v}, extra)
        self.save()

    def set_run(self, run: str, rows: dict[str, Any], extra: dict[str, Any]) -> None:
        """Put one run's rows and params in (replacing a run of that name)."""
        self.doc["runs"][run] = rows
        self.doc["params"][run] = extra

    def save(self) -> None:
        """Recompute the ratios and goals, draw the figure (unless told not to) and write."""
        r = ratios(self.doc["runs"])
        self.doc["ratios"] = {k: v for k, v in r.items() if k != "per_run"}
        self.doc["ratios_per_run"] = r["per_run"]
        self.doc["goals"] = goals(r)
        if self.draw:
            for name in ("cpu_real", "standin_8", "standin_32", "standin_64"):
                if name in self.doc["runs"]:
                    figure(self.doc["runs"], name, RESULTS / f"{NAME}.png")
                    self.doc["figure_run"] = name
                    break
        write(NAME, self.doc)


def gpu_spec(i: int, model: Path, work: Path) -> ReplicaSpec:
    """Replica ``i`` of the ``gpu`` run: ``vllm serve`` (0.26) on GPU 0, which both replicas
    share (``--gpu-memory-utilization 0.3`` each), otherwise as the CPU replicas (float32,
    eager, a 64 MiB KV cache, prefix caching)."""
    return ReplicaSpec(
        model=model,
        flavor="gpu",
        name=f"strategies-gpu-{i}",
        cpu_bind=None,
        cuda_visible_devices="0",
        extra_args=("--gpu-memory-utilization", "0.3"),
        env={"NCCL_NVLS_ENABLE": "0"},
        work_dir=work / f"replica-{i}",
        startup_timeout_s=480.0,
    )


async def start_gpu_replicas(model: Path, work: Path) -> list[LocalReplica]:
    """The ``gpu`` run's 2 replicas, one after the other (vLLM's start-up memory profiling
    assumes nobody else allocates on the GPU meanwhile); all or nothing."""
    reps: list[LocalReplica] = []
    try:
        for i in range(2):
            reps.append(LocalReplica(gpu_spec(i, model, work)))
            took = await reps[-1].start()
            print(f"[gpu] replica {i} serving at {reps[-1].url} after {took:.0f} s", flush=True)
    except BaseException:
        await stop_replicas(reps)
        raise
    return reps


def _gpu_name() -> str:
    """GPU 0's name from ``nvidia-smi`` ("" where it cannot say)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


async def real(run: str, a: argparse.Namespace, res: Results, work: Path) -> None:
    """A run on 2 real replicas (``cpu_real`` or ``gpu``): calibration, then the rounds. The
    ``cpu_real`` calibration becomes the stand-ins' time model (``calibration``); the ``gpu``
    one is recorded in the run's ``params`` with the host (``machine``, ``versions``, ``gpu``)."""
    p = params_for(run, a.short, 1.0)
    model = eos_marker(0, p.eos_prob)
    if run == "gpu":
        reps = await start_gpu_replicas(model, work / "replicas")
    else:
        reps = await start_replicas(model, 2, work / "replicas", name="strategies")
    try:
        urls = [r.url for r in reps]
        cal = await calibrate(urls, p)
        async with aiohttp.ClientSession() as http:  # trust a replica after one completion
            await served_model(http, urls[1])
        from pool.engine import VllmEngine

        engines = [VllmEngine(u, timeout=120) for u in urls]
        for e in engines:
            await e.bootstrap()
        await prepare_replicas(engines, p.eos_prob)
        extra: dict[str, Any] = {"replicas": 2, "short": a.short, **asdict(p)}
        if run == "gpu":
            host = meta()
            extra |= {"vllm": engines[0].capabilities.version, "gpu": _gpu_name(),
                      "machine": host["machine"], "versions": host["versions"],
                      "attribution": "markers", "rounds": a.rounds}  # fmt: skip
        for e in engines:
            await e.aclose()

        async def save(segs: dict[str, list[Segment]]) -> None:
            rows = {s: row(v) for s, v in segs.items() if v}
            per_replica = [r["steady_engine_tokens_per_s"] / 2 for r in rows.values()
                           if r.get("steady_engine_tokens_per_s")]  # fmt: skip
            if per_replica:
                cal["replica_tokens_per_s"] = round(sorted(per_replica)[len(per_replica) // 2], 1)
            if run == "cpu_real":
                res.doc["calibration"] = cal
            else:
                extra["calibration"] = cal
            res.put(run, segs, extra)

        await rounds(run, urls, p, a.rounds, work, save)
    finally:
        await stop_replicas(reps)


async def standin(n: int, a: argparse.Namespace, res: Results, work: Path) -> None:
    run = f"standin_{n}"
    cal = {**DEFAULT_CALIBRATION, **res.old_calibration, **res.doc.get("calibration", {})}
    dilate = a.dilate if n >= 32 else 1.0
    p = params_for(run, a.short, dilate)
    model = eos_marker(0, p.eos_prob)
    urls_file = work / f"{run}.json"
    proc = _spawn(
        [sys.executable, "-m", "testkit.standin", "--count", str(n), "--model", str(model),
         "--urls-file", str(urls_file),
         "--request-tps", str(cal["request_tokens_per_s"] / dilate),
         "--replica-tps", str(cal["replica_tokens_per_s"] / dilate),
         "--transfer-s", str(cal["transfer_s"] * dilate)],
        work / f"{run}.log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not urls_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((work / f"{run}.log").read_text()[-1500:])
            await asyncio.sleep(0.2)
        urls = json.loads(urls_file.read_text())["urls"]
        extra = {"replicas": n, "short": a.short, "dilate": dilate, "time_model": cal,
                 "machine": meta()["machine"], **asdict(p)}  # fmt: skip

        async def save(segs: dict[str, list[Segment]]) -> None:
            res.put(run, segs, extra)

        await rounds(run, urls, p, a.rounds, work, save)
    finally:
        terminate(proc)


async def main_async(a: argparse.Namespace) -> None:
    res = Results(RESULTS / f"{NAME}.json", keep_old=a.keep, draw=not a.no_figure)
    default_rounds = a.rounds
    # every policy's checkpoint built before any clock runs (a first build imports torch: tens
    # of seconds on a loaded box, which a publish must not include)
    p = params_for("cpu_real", a.short, 1.0)
    for g in range(MARKERS):
        await asyncio.to_thread(eos_marker, g, p.eos_prob)
    with tempfile.TemporaryDirectory(prefix="strategies-") as tmp:
        for item in a.runs.split(","):
            run, _, n_rounds = item.partition(":")
            a.rounds = int(n_rounds) if n_rounds else default_rounds
            print(f"=== {run} ({a.rounds} rounds)", flush=True)
            if run in REAL:
                await real(run, a, res, Path(tmp))
            else:
                await standin(int(run.split("_")[1]), a, res, Path(tmp))
    print(json.dumps({"ratios": res.doc.get("ratios"), "goals": res.doc.get("goals")}, indent=1))


def table(doc: dict[str, Any]) -> str:
    """The results as the docs' markdown table (one row per run and strategy)."""
    cols = [
        ("useful tok/s", "useful_tokens_per_s"),
        ("all tok/s", "all_tokens_per_s"),
        ("idle replica-s / update", "idle_replica_s_per_update"),
        ("trainer wait s (mean)", "trainer_wait_s_mean"),
        ("policy lag 0/1/2+", "policy_lag"),
        ("mixed samples", "mixed_samples"),
        ("wasted prefill tokens", "wasted_prefill_tokens"),
        ("cross-gen", "cross_generation_samples"),
        ("min steady fraction", "min_steady_fraction"),
    ]
    out = ["| run | strategy | " + " | ".join(c for c, _ in cols) + " |"]
    out.append("|---|---|" + "---|" * len(cols))
    for run, rows in doc["runs"].items():
        for s, r in rows.items():
            cells = []
            for _, key in cols:
                v = r.get(key)
                if key == "policy_lag":
                    lag = {int(k): n for k, n in (v or {}).items()}
                    n = sum(lag.values()) or 1
                    late = sum(c for k, c in lag.items() if k >= 2)
                    v = f"{lag.get(0, 0) / n:.0%}/{lag.get(1, 0) / n:.0%}/{late / n:.0%}"
                elif isinstance(v, float):
                    v = f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
                cells.append(str(v))
            out.append(f"| {run} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="python -m bench.strategies", description=__doc__)
    ap.add_argument(
        "--runs",
        default="cpu_real,standin_8,standin_32,standin_64",
        help="runs, each optionally with its own number of rounds: cpu_real:3,standin_64:1",
    )
    ap.add_argument("--short", action="store_true", help="CI-short: 2 steps per segment")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dilate", type=float, default=2.0, help="time dilation at N >= 32")
    ap.add_argument("--keep", action="store_true", help="keep other runs already in the file")
    ap.add_argument("--table", action="store_true", help="print the results file as markdown")
    ap.add_argument("--no-figure", action="store_true", help="no PNG (a host without matplotlib)")
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="put every run of these results files (e.g. from the GPU host, written with "
        "ROLLOUTPOOL_RESULTS elsewhere) into the results file, replacing runs of the same name",
    )
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads((RESULTS / f"{NAME}.json").read_text())))
        return
    if a.merge:
        res = Results(RESULTS / f"{NAME}.json", keep_old=True)
        for f in a.merge:
            other = json.loads(f.read_text())
            for run, rows in other["runs"].items():
                res.set_run(run, rows, other["params"][run])
        res.save()
        return
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
