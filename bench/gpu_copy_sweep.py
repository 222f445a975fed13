"""The replica's copy-and-checksum kernel (:func:`pool.ipc_sums.copy_sums`) across its launch
parameters, against the copy engine, on one GPU (no vLLM, no pydantic: runs on a bare GPU host).

The Qwen3-8B shapes (:func:`bench.gpu_kernels.shapes`: 399 tensors, 16.38 GB bf16, random)
laid out in one staging buffer (16-byte aligned) and copied into a second buffer of the same
layout, as ``ipc_direct`` copies a staged copy into the runtime parameters. For every
``(SUB, sub-blocks per block, num_warps)`` the kernel is compiled, run once, checked (every
destination word equals its source, and every tensor's ``(plain, weighted)`` equals the
shipped configuration's, which :mod:`pool.ipc_copy` checks against :mod:`pool.checksum` when
it loads it), then timed by CUDA events; the copy engine (``torch._foreach_copy_`` of the 399
tensors, and one copy of the whole buffer) is timed in the same run.

``python -m bench.gpu_copy_sweep --out $OUT/copy_sweep.json``; the result is committed as
``bench/results/gpu_copy_sweep.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_kernels import QWEN3_8B, shapes
from pool.checksum import MODULUS as MOD

SHIPPED = (4096, 4, 4)  # pool.ipc_sums.SUB, pool.ipc_copy.BLOCK // SUB, num_warps in _run


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Word offsets of tensors of ``sizes`` words, each 16-byte (8-word) aligned; total words."""
    offs, at = [], 0
    for n in sizes:
        offs.append(at)
        at += -(-n // 8) * 8
    return offs, at


def table(sizes: list[int], block: int, device: Any) -> tuple[Any, Any]:
    """``(seg, start)`` of :mod:`pool.ipc_sums` for tensors of ``sizes`` words, as
    :func:`pool.ipc_copy.block_table` builds them (not imported: that module needs pydantic,
    which the bare GPU host lacks)."""
    import torch

    seg: list[int] = []
    start: list[int] = []
    for i, n in enumerate(sizes):
        k = -(-n // block)
        seg.extend([i] * k)
        start.extend(range(0, k * block, block))
    i64: dict[str, Any] = {"dtype": torch.int64, "device": device}
    return torch.tensor(seg, **i64), torch.tensor(start, **i64)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_copy_sweep")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch

    from pool import ipc_sums

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    sizes = [int(torch.Size(s).numel()) for s in shapes(QWEN3_8B)]
    offs, total = layout(sizes)
    g = torch.Generator(device=dev).manual_seed(0)
    src = torch.empty(total, dtype=torch.int16, device=dev)
    for o, n in zip(offs, sizes, strict=True):  # random bf16 values, as weights
        src[o : o + n] = torch.randn(n, generator=g, device=dev).bfloat16().view(torch.int16)
    dst = torch.zeros_like(src)
    i64: dict[str, Any] = {"dtype": torch.int64, "device": dev}
    src_addr = torch.tensor([src.data_ptr() + 2 * o for o in offs], **i64)
    dst_addr = torch.tensor([dst.data_ptr() + 2 * o for o in offs], **i64)
    nwords = torch.tensor(sizes, **i64)
    nbytes = 2 * sum(sizes)

    def timed(fn: Any) -> float:
        fn()  # warm-up (and compile)
        times: list[float] = []
        cuda: Any = torch.cuda
        for _ in range(args.reps):
            a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(float(a.elapsed_time(b)) / 1e3)
        return sorted(times)[len(times) // 2]

    srcs = [src[o : o + n] for o, n in zip(offs, sizes, strict=True)]
    dsts = [dst[o : o + n] for o, n in zip(offs, sizes, strict=True)]
    engine = {
        "foreach_copy_s": timed(lambda: torch._foreach_copy_(dsts, srcs)),
        "one_copy_s": timed(lambda: dst.copy_(src)),
    }
    rows: list[dict[str, Any]] = []
    reference: Any = None
    variants = [(4096, 4, 4)] + [
        (sub, m, w)
        for sub in (2048, 4096, 8192)
        for m in (4, 8, 15)
        for w in (4, 8, 16)
        if (sub, m, w) != SHIPPED and sub * m <= MOD
    ]
    for sub, m, warps in variants:
        block = sub * m
        seg, start = table(sizes, block, dev)
        out = torch.empty((seg.numel(), 2), dtype=torch.int64, device=dev)
        launch = functools.partial(
            ipc_sums._partials[(seg.numel(),)],
            src_addr, dst_addr, seg, start, nwords, out,
            BLOCK=block, SUB=sub, MOD=MOD, COPY=True, num_warps=warps,
        )  # fmt: skip

        row: dict[str, Any] = {"sub": sub, "sub_blocks": m, "block": block, "num_warps": warps}
        try:
            dst.zero_()
            t0 = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 3)
            sums = torch.zeros((len(sizes), 2), **i64).index_add_(0, seg, out)
            row["copy_exact"] = bool(torch.equal(dst, src))
            if reference is None:
                reference = sums
            row["sums_equal_shipped"] = bool(torch.equal(sums, reference))
            s = timed(launch)
            row.update(kernel_s=round(s, 5), GBps=round(nbytes / s / 1e9, 1))
        except Exception as e:  # a configuration Triton cannot compile (registers, shared memory)
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if r.get("copy_exact") and r.get("sums_equal_shipped")]
    best = min(ok, key=lambda r: r["kernel_s"]) if ok else None
    result = {
        "what": "copy + checksum kernel of ipc_direct across launch parameters, 8B shape",
        "bytes": nbytes,
        "tensors": len(sizes),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "reps": args.reps,
        "copy_engine": {
            **{k: round(v, 5) for k, v in engine.items()},
            "foreach_GBps": round(nbytes / engine["foreach_copy_s"] / 1e9, 1),
            "one_copy_GBps": round(nbytes / engine["one_copy_s"] / 1e9, 1),
        },
        "shipped": rows[0],
        "best": best,
        "variants": rows,
        "command": "python -m bench.gpu_copy_sweep --out $OUT/copy_sweep.json",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("copy_engine", "shipped", "best")}, indent=1))


if __name__ == "__main__":
    main()
