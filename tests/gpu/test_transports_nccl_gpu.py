"""The NCCL transport on real GPU replicas, through ``bench/gpu_update.py``'s phases.

Run on the GPU host (``README.md`` here): ``source tests/gpu/gpu_env.sh`` then
``CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/gpu -p no:cacheprovider``.
``ROLLOUTPOOL_GPU_MODEL`` picks the model (default ``/tmp/models/qwen3-8b-shape``; ``tiny`` is
quicker). Each test runs the harness as a subprocess (its own event loop and CUDA context) and
checks what it wrote; the JSON stays under ``$OUT`` (or a temp dir) for inspection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
MODEL = os.environ.get("ROLLOUTPOOL_GPU_MODEL", "/tmp/models/qwen3-8b-shape")
ROOT = Path(__file__).resolve().parents[2]


def run_phases(phases: str, tmp_path: Path, *extra: str, timeout: int = 900) -> dict[str, Any]:
    out = Path(os.environ.get("OUT", tmp_path)) / f"gpu_{phases.replace(',', '')}.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", NCCL_NVLS_ENABLE="0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_update",
            "--phases",
            phases,
            "--model",
            MODEL,
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.read_text())
    assert "fatal" not in res, res.get("traceback")
    return res


def test_single_replica_cycle_sweep_and_restart(tmp_path: Path) -> None:
    res = run_phases("raw,a,b", tmp_path)
    assert res["raw_nccl_GBps"] > 50
    assert res["bootstrap"]["report"]["outcome"] == "ready"
    assert not res["bootstrap"]["dummy_vs_g0"]["ok"], "dummy weights must not pass the check"
    cycle = res["cycle"]
    assert cycle["report"]["outcome"] == "ready" and cycle["check"]["ok"]
    assert not cycle["g0_replica_vs_g1"]["ok"], "the check must tell generations apart"
    assert res["transfer_GBps"] > 10 and 0 < res["window_s"] < 30
    assert all(row.get("valid") for row in res["sweep"]), res["sweep"]
    assert res["restart"]["bootstrap"]["outcome"] == "ready"
    assert res["restart_over_hot"] > 1


def test_rolling_update_under_load_and_stuck_collective(tmp_path: Path) -> None:
    res = run_phases("c,d", tmp_path)
    rolling = res["rolling"]
    assert rolling["updates"] == 4 and rolling["rollouts"] > 0
    assert rolling["cross_generation"] == 0, rolling["verification"]
    assert rolling["errors"] == 0, rolling["error_examples"]
    stuck = res["stuck"]
    assert stuck["store_state"] == "TAINTED"
    assert stuck["tainted_after_s"] <= stuck["deadline_s"]
    assert stuck["recovered"] is True
    assert stuck["r0_rollouts_while_r1_down"] > 0
