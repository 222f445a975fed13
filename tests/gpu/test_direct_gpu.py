"""``nccl_direct``, staging and checksum validation on real GPU replicas, through
``bench/gpu_direct.py`` (run on the GPU host: ``README.md`` here; never in CI).

One run of the bench (two replicas with RolloutPool's worker extension) and what must hold in
its result: every cycle of both paths READY with the teacher-forced check passing and the
checksums equal; the staged trainer stall below one transfer with one and two replicas; 0
cross-generation rollouts; both negative controls (one flipped bit on the wire, a transfer cut
after 90 %) TAINTED by checksum validation and never published; the restarted replica
recovered over ``nccl_direct``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_direct_path_staging_rolling_and_negative_controls(tmp_path: Path) -> None:
    out = Path(os.environ.get("OUT", tmp_path)) / "gpu_direct.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", NCCL_NVLS_ENABLE="0")
    argv = ["--phases", "raw,ab,staging,rolling,negative,restart", "--out", str(out)]
    argv += ["--work", str(tmp_path / "work"), "--budget-s", "900"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_direct", *argv],
        cwd=ROOT,
        env=env,
        timeout=1500,
        capture_output=True,
        text=True,
    )
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "fatal" not in res and not res.get("errors"), res.get("traceback") or res.get("errors")
    for path in ("nccl_direct", "nccl"):
        s = res["ab"]["summary"][path]
        assert s["ready"] == s["cycles"] == s["checks_ok"], (path, s)
    assert not res["bootstrap"]["dummy_vs_g0"]["ok"], "dummy weights must fail the check"
    one_transfer = res["ab"]["summary"]["nccl_direct"]["transfer_s"]
    for n in ("n1", "n2"):
        st = res["staging"][n]
        assert st["all_ready"] and st["staged_stall_s"] < one_transfer, st
    assert res["rolling"]["cross_generation"] == 0 and res["rolling"]["errors"] == 0
    neg = res["negative_controls"]
    for name, kind in (("flip_one_bit", "mismatched=1"), ("cut_after_90_percent", "missing=")):
        assert neg[name]["store_state"] == "TAINTED" and kind in neg[name]["reason"], neg[name]
    assert neg["never_published"]
    assert res["restart"]["recovery"]["outcome"] == "ready"
