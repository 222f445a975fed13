"""``bench/results/gpu_update.json`` from the parts :mod:`bench.gpu_kernels` and
:mod:`bench.gpu_direct` write on the GPU host (``python -m bench.gpu_direct merge ...``): the
headline (8B, ``nccl_direct``), both paths side by side, the per-step breakdown, trainer stall,
checksum cost, negative controls, the 32B rows and the goals, met or not."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from testkit.stats import med

GOALS = {
    "whole_transfer_GBps": 300.0,
    "window_s": 0.12,
    "restart_over_hot": 500.0,
}


def merge(
    kernels: Path, run8b: Path, run32b: Path | None, first8b: Path | None, previous: Path
) -> dict[str, Any]:
    """``bench/results/gpu_update.json`` from this benchmark's parts: the headline (8B), the
    two paths side by side, the per-step breakdown, trainer stall, checksum cost, the negative
    controls, the 32B rows, the goals; every part in ``details``. ``previous`` is the result
    file being replaced: its headline is kept under ``details.previous_result_headline`` (so
    merge into a fresh copy of the committed file, not twice into the same one)."""
    k = json.loads(kernels.read_text())
    d = json.loads(run8b.read_text())
    big = json.loads(run32b.read_text()) if run32b else None
    first = json.loads(first8b.read_text()) if first8b else None
    old = json.loads(previous.read_text())
    direct, vllm = d["ab"]["summary"]["nccl_direct"], d["ab"]["summary"]["nccl"]
    rows = [r["transfer"] for r in d["ab"]["nccl_direct"] if r.get("outcome") == "ready"]
    waits = [r["receive"].get("checksum_wait_s", 0.0) for r in rows]
    control = [r["transfer_s"] - r["receive"]["receive_s"] for r in rows]
    st = d["staging"]
    one_transfer = direct["transfer_s"]
    stall = {
        "staged": {n[1:]: st[n]["staged_stall_s"] for n in ("n1", "n2")},
        "in_process": {n[1:]: st[n]["in_process_stall_s"] for n in ("n1", "n2")},
        "one_transfer_s": one_transfer,
    }
    out: dict[str, Any] = {
        "model": "qwen3-8b-shape",
        "bytes": d["bytes"],
        "tensors": d["tensors"],
        "gpu": d["gpu"],
        "vllm_version": d["vllm_version"],
        "torch": k.get("torch"),
        "triton": k.get("triton"),
        "raw_nccl_GBps": d["raw_nccl_GBps"],
        "transport": "nccl_direct",
        "transfer_s": direct["transfer_s"],
        "transfer_GBps": direct["transfer_GBps"],
        "replica_receive_GBps": direct["replica_receive_GBps"],
        "window_s": direct["window_s"],
        "restart_s": d["restart"]["start_to_serving_s"],
        "restart_over_hot": d["restart"]["restart_over_hot"],
        "trainer_stall_s": stall,
        "checksum_s": {
            "sender_overlapped_with_send": direct["checksum_s"],
            "replica_after_last_tensor": med(waits),
            "compare_in_validating": direct.get("phase_checksum_s"),
            "kernel_alone_triton": min(k["triton_s"]),
            "kernel_alone_torch_fallback": k["torch_fallback_s"],
            "separate_call_after_load_first_run": (first or {})
            .get("ab", {})
            .get("summary", {})
            .get("nccl_direct", {})
            .get("phase_checksum_s"),
        },
        "paths": {"nccl_direct": direct, "nccl": vllm},
        "breakdown": {
            "nccl_direct": {
                "window_phases_s": {
                    p: direct.get(f"phase_{p}_s")
                    for p in ("transfer", "invalidate", "checksum", "validate", "resume")
                },
                "sender_enqueue_s": direct["send_enqueue_s"],
                "sender_send_s": direct["send_s"],
                "replica_receive_s": direct["replica_receive_s"],
                "control_path_s": med(control),
                "wire_at_raw_s": round(d["bytes"] / d["raw_nccl_GBps"] / 1e9, 4),
            },
            "nccl": {
                "window_phases_s": {
                    p: vllm.get(f"phase_{p}_s")
                    for p in ("transfer", "invalidate", "validate", "resume")
                },
                "start_weight_update_s": vllm["start_s"],
                "update_weights_s": vllm["update_http_s"],
                "update_weights_GBps": round(d["bytes"] / vllm["update_http_s"] / 1e9, 1),
                "finish_weight_update_s": vllm["finish_s"],
                "sender_send_s": vllm["send_s"],
            },
        },
        "rolling": d["rolling"],
        "negative_controls": {
            "flip_one_bit": _short(d["negative_controls"]["flip_one_bit"]),
            "cut_after_90_percent": _short(d["negative_controls"]["cut_after_90_percent"]),
            "never_published": d["negative_controls"]["never_published"],
        },
    }
    if big is not None:
        b = big["ab"]["summary"]["nccl_direct"]
        out["qwen3_32b_shape"] = {
            "bytes": big["bytes"],
            "tensors": big["tensors"],
            "transfer_s": b["transfer_s"],
            "transfer_GBps": b["transfer_GBps"],
            "replica_receive_GBps": b["replica_receive_GBps"],
            "window_s": b["window_s"],
            "restart_s": big["restart"]["start_to_serving_s"],
            "restart_over_hot": big["restart"]["restart_over_hot"],
            "cold_start_s": big["cold_start_s"],
            "checks": big.get("teacher_forced_checks"),
            "summary": b,
        }
    met = {
        "whole_transfer_GBps": direct["transfer_GBps"] >= GOALS["whole_transfer_GBps"],
        "window_s": statistics.median(
            r["window_s"] for r in d["ab"]["nccl_direct"] if r.get("outcome") == "ready"
        )
        <= GOALS["window_s"],
        "restart_over_hot": d["restart"]["restart_over_hot"] >= GOALS["restart_over_hot"],
        "trainer_stall_le_one_transfer": max(stall["staged"].values()) <= one_transfer,
        "cross_generation_zero": d["rolling"]["cross_generation"] == 0,
        "teacher_forced_every_update": direct["checks_ok"] == direct["ready"]
        and vllm["checks_ok"] == vllm["ready"],
    }
    out["goals"] = {"targets": GOALS, "met": met}
    out["details"] = {
        "kernels": k,
        "run_8b": d,
        "run_32b": big,
        "first_8b_run_summary": None
        if first is None
        else {
            "ab_summary": first["ab"]["summary"],
            "note": "replica checksums by a separate call after the load",
        },
        "previous_result_headline": {
            key: old.get(key)
            for key in (
                "transfer_s",
                "transfer_GBps",
                "window_s",
                "restart_s",
                "stuck",
                "breakdown",
            )
        },
    }
    return out


def _short(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ("outcome", "store_state", "generation", "reason")}


def merge_waves(run: Path, previous: Path) -> dict[str, Any]:
    """``previous`` (``bench/results/gpu_update.json``) with the 4-GPU run of
    :mod:`bench.gpu_waves` added under ``waves`` and ``tp2`` (the whole run under
    ``details.run_4gpu_waves``); everything else is kept as it was."""
    d = json.loads(run.read_text())
    out: dict[str, Any] = json.loads(previous.read_text())
    by_k = d.get("waves", {})
    k3, rolling = by_k.get("k3", {}), d.get("rolling", {})
    head = {
        "model": Path(d.get("model", "")).name,
        "gpu": d.get("gpu"),
        "vllm_version": d.get("vllm_version"),
        "bytes": d.get("bytes"),
        "enforce_eager": "--cuda-graphs" not in " ".join(d.get("argv", [])),
    }
    out["waves"] = {
        **head,
        "replicas_per_broadcast": k3.get("replicas_per_broadcast"),
        "wave_s": k3.get("wave_s"),
        "sequential_s": k3.get("sequential_s"),
        "cross_generation": rolling.get("cross_generation"),
        "by_k": {k: {key: v for key, v in row.items() if key != "reps"} for k, row in by_k.items()},
        "rolling": {key: v for key, v in rolling.items() if key not in ("rolls", "verification")},
    }
    tp = d.get("tp2", {})
    out["tp2"] = {
        **head,
        "verified": bool(tp.get("verified")),
        "transfer_GBps": tp.get("transfer_GBps"),
        **{k: v for k, v in tp.items() if k not in ("verified", "transfer_GBps", "cycles")},
    }
    out.setdefault("details", {})["run_4gpu_waves"] = d
    return out
