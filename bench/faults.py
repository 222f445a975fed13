"""``python -m bench.faults``: the fault matrix (:mod:`testkit.fault_cells`) on stand-in
replicas, every cell, and writes ``bench/results/faults.json``.

Every component (updater, router, replica, redis, sentinel) x every phase of an update (READY
through RESUMING, and RECOVERING) x {SIGKILL, SIGSTOP past the lease, SIGTERM, restart}, plus two
updaters at once and replication stalled in every phase. ``redis`` cells run on a rig with one
standalone Redis, ``sentinel`` and ``replication_stalled`` cells on a rig with a Sentinel group
(:mod:`testkit.fault_redis`). Each cell is checked like a Jepsen checker
(:class:`testkit.faults.Rig`): tokens against markers, stale fencing tokens in the journal,
bindings left active, update records left running, and the time from the fault until every
replica is READY on the latest generation, against the bound the docs state::

    converge_bound_s = lease TTL + one replica restart + one update window

(the restart and the window measured here: a stand-in restart with the updater's health check,
``RESTART_S``, and the slowest held update, ``WINDOW_S``). Orphaned processes are a question of
real processes: ``--real`` adds the real-vLLM sample of ``tests/integration/test_updater_faults.py``
(:func:`testkit.fault_cells.real_sample`), whose updaters launch and lose real replicas.
``--first-wave 2`` plays the cells on updaters that update both replicas before the publish,
holding both in the phase (:data:`testkit.fault_cells.WAVE_PHASES`); ``--merge`` adds them as
rows of their own (``first_wave`` 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench._meta import RESULTS, write
from pool.types import ReplicaState as S
from testkit.fault_cells import (
    COMPONENTS,
    EXTRA,
    FAULTS,
    GRANT_PHASES,
    PHASES,
    WAVE_PHASES,
    Matrix,
    real_sample,
    redis_of,
)
from testkit.fault_redis import RedisKind
from testkit.faults import Rig

LEASE_S = 3.0
RESTART_S = 10.0  # a stand-in's restart, found by the supervisor (health checks) and re-joined
WINDOW_S = 10.0  # one update window, a held phase (3 s) included, with margin


def with_sample(result: dict[str, Any], sample: dict[str, Any]) -> dict[str, Any]:
    """``result`` (the matrix's totals) with the real-vLLM sample added to them."""
    out = {**result, "real_vllm_sample": sample}
    out["cross_generation"] = result["matrix_cross_generation"] + sample["cross_generation"]
    out["stale_token_writes"] = result["matrix_stale_token_writes"] + len(
        sample["stale_token_writes"]
    )
    out["leaked_bindings"] = result["matrix_leaked_bindings"] + sample["leaked_bindings"]
    out["orphaned_processes"] = len(sample["orphaned_processes"])
    out["records_left_running"] = result["matrix_records_left_running"] + len(
        sample["records_left_running"]
    )
    return out


def cells(
    only: list[str], phases: list[str], faults: list[str], first_wave: int = 1
) -> dict[RedisKind, list[tuple[str, S, str]]]:
    """The cells to play (``faults`` filters by fault name), by the rig's Redis they need; with
    a ``first_wave`` above 1, only in the phases a whole first wave is held in."""
    out: dict[RedisKind, list[tuple[str, S, str]]] = {}
    for p in PHASES:
        if p.value not in phases or (first_wave > 1 and p not in WAVE_PHASES):
            continue
        pairs = [(c, f) for c in COMPONENTS for f in FAULTS] + list(EXTRA)
        for c, f in pairs:
            if f.endswith("_under_grant") and p not in GRANT_PHASES:
                continue
            if c in only and f in faults:
                out.setdefault(redis_of(c), []).append((c, p, f))
    return out


async def play(
    workdir: Path, redis: RedisKind, todo: list[tuple[str, S, str]], first_wave: int = 1
) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
    """Play ``todo`` on one rig; returns the rows, the bindings left active and the verdict."""
    rows: list[dict[str, Any]] = []
    async with Rig(
        workdir / redis,
        replicas=2,
        lease_s=LEASE_S,
        backend="standin",
        redis=redis,
        first_wave=first_wave,
    ) as rig:
        rig.load(clients=4, max_tokens=100)
        matrix = Matrix(rig)
        await matrix.start()
        for c, p, f in todo:
            res = await matrix.play(c, p, f)
            rows.append(res.row())
            print(
                f"{c:8} {p.value:13} {f:19} hit={res.phase_hit!s:5} "
                f"converge={res.converge_s} next={res.next_update} {res.steps} "
                f"{'FAILED ' + res.error if res.failed else 'ok'}",
                flush=True,
            )
        leaked = await rig.quiesce()
        verdict = await rig.verdict()
    return rows, leaked, verdict


async def run(
    workdir: Path,
    only: list[str],
    phases: list[str],
    faults: list[str],
    real: bool,
    first_wave: int = 1,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    leaked = cross = answers = 0
    stale: list[str] = []
    errors: Counter[str] = Counter()
    for redis, todo in cells(only, phases, faults, first_wave).items():
        r, lk, v = await play(workdir, redis, todo, first_wave)
        rows += r
        leaked += lk
        cross += v["cross_generation"]
        stale += v["stale_token_writes"]
        answers += v["answers"]
        errors.update(v["client_errors"])
    converges = [r["converge_s"] for r in rows if r["converge_s"] is not None]
    result: dict[str, Any] = {
        "cells": len(rows),
        "cells_failed": sum(1 for r in rows if r["failed"]),
        "cells_phase_hit": sum(1 for r in rows if r["phase_hit"]),
        "cross_generation": cross,
        "stale_token_writes": len(stale),
        "leaked_bindings": leaked,
        "orphaned_processes": None,  # a question of real processes: the real-vLLM sample
        "records_left_running": sum(r["records_left_running"] for r in rows),
        "max_converge_s": max(converges, default=None),
        "converge_bound_s": LEASE_S + RESTART_S + WINDOW_S,
        "answers": answers,
        "client_errors": dict(errors),
        "stale_token_write_entries": stale[:10],
        "wall_s": round(time.monotonic() - t0, 1),
        "rows": rows,
    }
    for key in ("cross_generation", "stale_token_writes", "leaked_bindings"):
        result[f"matrix_{key}"] = result[key]
    result["matrix_records_left_running"] = result["records_left_running"]
    if real:
        result = with_sample(result, await real_sample(workdir / "real"))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.faults")
    ap.add_argument("--components", nargs="+", default=list(COMPONENTS), choices=COMPONENTS)
    ap.add_argument(
        "--phases", nargs="+", default=[p.value for p in PHASES], choices=[p.value for p in PHASES]
    )
    every_fault = [*FAULTS, *(f for _, f in EXTRA)]
    ap.add_argument("--faults", nargs="+", default=every_fault, choices=every_fault)
    ap.add_argument("--workdir", type=Path, help="keep the rigs' logs here (default: a temp dir)")
    ap.add_argument("--real", action="store_true", help="add the real-vLLM sample")
    ap.add_argument(
        "--real-only",
        action="store_true",
        help="run only the real-vLLM sample and add it to the existing results file",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace the cells this run plays in the existing results file, keep the others",
    )
    ap.add_argument(
        "--first-wave",
        type=int,
        default=1,
        help="the updaters' first_wave (2: both replicas update before the publish, and every "
        "cell holds both; only the phases a whole first wave can be held in)",
    )
    ap.add_argument("--name", default="faults")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        d = args.workdir or Path(tmp)
        if args.real_only:
            old = json.loads((RESULTS / f"{args.name}.json").read_text())
            result = with_sample(old, asyncio.run(real_sample(d / "real")))
            result["matrix_command"], result["matrix_date"] = old["command"], old["date"]
        else:
            result = asyncio.run(
                run(d, args.components, args.phases, args.faults, args.real, args.first_wave)
            )
            if args.merge:
                result = merged(json.loads((RESULTS / f"{args.name}.json").read_text()), result)
    write(args.name, result)


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the cells ``new`` played replaced by ``new``'s; counts that are the whole
    run's (cross-generation, stale tokens, leaked bindings, answers) add up both runs."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:  # rows from before first_wave: 1
        return (r["component"], r["phase"], r["fault"], r.get("first_wave", 1))

    replaced = {key(r) for r in new["rows"]}
    rows = [r for r in old["rows"] if key(r) not in replaced] + new["rows"]
    converges = [r["converge_s"] for r in rows if r["converge_s"] is not None]
    out = {**old, "rows": rows}
    out.update(
        cells=len(rows),
        cells_failed=sum(1 for r in rows if r["failed"]),
        cells_phase_hit=sum(1 for r in rows if r["phase_hit"]),
        # rows of results written before a check existed lack its key: counted as unknown (0)
        records_left_running=sum(r.get("records_left_running", 0) for r in rows),
        max_converge_s=max(converges, default=None),
        answers=(old.get("answers") or 0) + new["answers"],
        merged_runs=[*old.get("merged_runs", [old["date"]]), "this run"],
    )
    # a check the old run did not complete (null) stays null: unknown for its cells; the merged
    # run's own totals are kept apart
    out["last_merged_run"] = {
        k: new[k] for k in ("cells", "cross_generation", "stale_token_writes", "leaked_bindings")
    }
    for k in ("cross_generation", "stale_token_writes", "leaked_bindings"):
        for field in (k, f"matrix_{k}"):
            before = old.get(field, old.get(k))
            out[field] = None if before is None else before + new[field]
    out["matrix_records_left_running"] = out["records_left_running"]
    return out


if __name__ == "__main__":
    main()
