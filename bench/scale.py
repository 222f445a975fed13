"""The pool at scale: N stand-in replicas, R router processes, one updater, one Redis.

    flock /work/heavy.lock python -m bench.scale [--matrix 8:1:1,64:4:N/8,128:4:N/8] [--updates 5]

Each configuration ``N:R:k`` (k is a number or ``N/8``, ``N/4``) runs
:func:`testkit.scenarios.scale.scenario` from scratch: real ``redis-server``, R real
``python -m router`` processes, a real ``python -m updater`` whose external replicas are N
stand-ins served by one ``python -m testkit.standin`` process, closed-loop load from this
process (single-request rollouts; sessions too during the rolls), ``--updates`` generations
rolled with ``max_unavailable`` k. The issue's full matrix is N in {8, 32, 64, 128} x R in
{1, 2, 4} x k in {1, N/8, N/4}; on a 2-core box that is hours (k=1 at N=128 is 128
drain+update windows per update), so ``--matrix`` picks the configurations and the JSON says
which ran (``matrix``). The default covers every N, every R and every k, and the goal's
configuration (64:4:N/8).

Writes ``bench/results/scale.json`` after every configuration (a cut-off run keeps what it
measured): ``rows`` (one per configuration), ``replicas_max``, ``routers_max``, the totals
``cross_generation`` and ``leaked_bindings``, and for N=64, R=4, k=N/8 the goal figures
``roll_over_window_ratio`` (worst update: full roll time / the median replica's drain+update
window of that update), ``capacity_ratio_vs_ideal`` (minimum sampled admitting capacity during
the rolls over (N-k)/N) and ``redis_commands_per_rollout`` (commands a single-request rollout
sends to Redis, from ``MONITOR``), with ``goals`` saying which held; and per router count the
idle Redis commands/s by N (``redis_idle_flat_in_n``: the largest pool's within 25 % of the
smallest's, the view coming by change feed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from bench._meta import write
from testkit.scenarios.scale import Params, scenario

#: the goal's configuration and N=128 first (a run cut short still has them), then every N, R, k
DEFAULT = (
    "64:4:N/8,128:4:N/8,8:1:1,8:2:N/4,32:1:1,32:2:N/8,32:4:N/4,64:1:N/8,64:4:N/4,128:2:N/8,"
    "128:4:N/4"
)
GOAL = (64, 4, "N/8")


def parse_matrix(text: str) -> list[tuple[int, int, str]]:
    """``"64:4:N/8,8:1:1"`` -> ``[(64, 4, "N/8"), (8, 1, "1")]`` (k validated by :func:`k_of`)."""
    out = []
    for item in text.split(","):
        n, r, k = item.strip().split(":")
        out.append((int(n), int(r), k))
        k_of(int(n), k)
    return out


def k_of(n: int, k: str) -> int:
    if k.startswith("N/"):
        return max(1, n // int(k[2:]))
    if not k.isdigit() or not 1 <= int(k) <= n:
        raise argparse.ArgumentTypeError(f"k must be 1..N or N/<d>, not {k!r}")
    return int(k)


def summary(rows: list[dict[str, Any]], matrix: list[tuple[int, int, str]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {
        "matrix": [f"{n}:{r}:{k}" for n, r, k in matrix],
        "ran": [r["config"] for r in done],
        "failed": [{"config": r["config"], "error": r["error"]} for r in rows if "error" in r],
        "replicas_max": max((r["replicas"] for r in done), default=0),
        "routers_max": max((r["routers"] for r in done), default=0),
        "cross_generation": sum(r["cross_generation"] for r in done),
        "leaked_bindings": sum(r["leaked_bindings"] for r in done),
        "all_on_last_generation": all(r["all_on_last_generation"] for r in done),
    }
    idle: dict[int, dict[int, float]] = {}
    for r in done:
        idle.setdefault(r["routers"], {})[r["replicas"]] = r["redis_idle_commands_per_s"]
    out["redis_idle_commands_per_s_by_routers_and_replicas"] = idle
    flat = {
        routers: round(by_n[max(by_n)] / by_n[min(by_n)], 2)
        for routers, by_n in idle.items()
        if len(by_n) > 1 and by_n[min(by_n)] > 0
    }
    if flat:
        # idle load independent of N: the largest pool's idle commands/s over the smallest's
        out["redis_idle_largest_over_smallest_n"] = flat
        out["redis_idle_flat_in_n"] = all(x <= 1.25 for x in flat.values())
    goal = next((r for r in done if r["config"] == "{}:{}:{}".format(*GOAL)), None)
    if goal is not None:
        n, k = goal["replicas"], goal["k"]
        out |= {
            "roll_over_window_ratio": goal["roll_over_window_ratio_max"],
            "capacity_ratio_vs_ideal": goal["capacity_ratio_vs_ideal"],
            "redis_commands_per_rollout": goal["redis_commands_per_rollout"],
            "redis_commands_per_rollout_all": goal["redis_commands_per_rollout_all"],
        }
        out["goals"] = {
            "cross_generation_0": out["cross_generation"] == 0,
            "roll_le_12_windows": (goal["roll_over_window_ratio_max"] or 99) <= 12,
            "capacity_ge_0.9_ideal": (goal["capacity_ratio_vs_ideal"] or 0) >= 0.9,
            "redis_le_4_commands_per_rollout": (goal["redis_commands_per_rollout"] or 99) <= 4,
            "ideal": f"(N-k)/N = ({n}-{k})/{n}",
        }
    return out


def _logs(tmp: str) -> dict[str, str]:
    """The tails of a failed configuration's process logs."""
    return {f.name: f.read_text(errors="replace")[-1500:] for f in sorted(Path(tmp).glob("*.log"))}


def main(argv: list[str] | None = None) -> None:
    # SIGTERM unwinds like Ctrl-C, so every configuration's processes are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--matrix", default=DEFAULT, help=f"N:R:k,... (default {DEFAULT})")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--steady-s", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--name", default="scale", help="results file name (bench/results/NAME.json)")
    a = ap.parse_args(argv)
    matrix = parse_matrix(a.matrix)
    rows: list[dict[str, Any]] = []
    for n, r, k in matrix:
        config = f"{n}:{r}:{k}"
        p = Params(
            replicas=n,
            routers=r,
            k=k_of(n, k),
            updates=a.updates,
            steady_s=a.steady_s,
            concurrency=a.concurrency,
        )
        print(f"--- {config} (k={p.k})", flush=True)
        with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
            try:
                row = {"config": config, **asyncio.run(scenario(p, Path(tmp)))}
            except Exception as e:  # reported in the result; the matrix goes on
                traceback.print_exc()
                row = {"config": config, "error": f"{type(e).__name__}: {e}", "logs": _logs(tmp)}
        rows.append(row)
        keys = ("rollouts_per_s", "roll_over_window_ratio_max", "capacity_ratio_vs_ideal")
        brief = {x: row.get(x) for x in (*keys, "cross_generation", "leaked_bindings", "error")}
        print(json.dumps(brief), flush=True)
        write(a.name, {**summary(rows, matrix), "rows": rows})
    print(json.dumps(summary(rows, matrix), indent=1))


if __name__ == "__main__":
    main()
