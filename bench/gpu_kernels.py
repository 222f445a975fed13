"""The checksum kernels and the staging copy alone, on one GPU (no vLLM, no pydantic: runs on a
bare GPU host before the vLLM bundle is unpacked).

Tensors of the Qwen3-8B shapes (399 tensors, 16.38 GB bf16, random) on ``cuda:0``:

* :func:`pool.checksum.tensor_checksums` by the fused Triton reduction (after a warm-up that
  JIT-compiles it) vs the torch fallback: equal results required, both timed; the numpy path
  on a few small tensors copied to the host, equal as well;
* the staging copy as :meth:`~updater.transports.nccl.StagedSource.stage` does it (one
  ``torch._foreach_copy_`` device-to-device, then a stream sync), timed.

``python -m bench.gpu_kernels --out $OUT/kernels.json`` (``bench.gpu_direct --phases kernels``
runs the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

QWEN3_8B = {"hidden": 4096, "q": 4096, "kv": 1024, "ff": 12288, "vocab": 151936, "layers": 36}


def shapes(m: dict[str, int]) -> list[tuple[int, ...]]:
    h = m["hidden"]
    out: list[tuple[int, ...]] = [(m["vocab"], h), (m["vocab"], h), (h,)]
    for _ in range(m["layers"]):
        out += [(m["q"], h), (m["kv"], h), (m["kv"], h), (h, m["q"])]
        out += [(m["ff"], h), (m["ff"], h), (h, m["ff"]), (h,), (h,), (128,), (128,)]
    return out


def measure(model: dict[str, int] = QWEN3_8B, reps: int = 3) -> dict[str, Any]:
    import torch

    from pool import checksum

    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        (f"t{i}", torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16))
        for i, s in enumerate(shapes(model))
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    out: dict[str, Any] = {"tensors": len(tensors), "bytes": nbytes}

    def timed(fn: Any) -> tuple[float, Any]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, r

    t_first, _ = timed(lambda: checksum.tensor_checksums(tensors, use_triton=True))
    out["triton_first_call_s"] = round(t_first, 3)  # includes the JIT compile
    tri = [timed(lambda: checksum.tensor_checksums(tensors, use_triton=True)) for _ in range(reps)]
    t_torch, by_torch = timed(lambda: checksum.tensor_checksums(tensors, use_triton=False))
    best = min(t for t, _ in tri)
    out["triton_s"] = [round(t, 4) for t, _ in tri]
    out["triton_GBps"] = round(nbytes / best / 1e9, 1)
    out["torch_fallback_s"] = round(t_torch, 4)
    out["equal_triton_torch"] = tri[0][1] == by_torch
    small = tensors[-12:]
    out["equal_numpy_small"] = checksum.tensor_checksums(
        [(n, t.cpu()) for n, t in small]
    ) == checksum.tensor_checksums(small, use_triton=True)
    staged = [torch.empty_like(t) for _, t in tensors]
    srcs = [t for _, t in tensors]

    def stage() -> None:
        torch._foreach_copy_(staged, srcs)
        torch.cuda.current_stream().synchronize()

    stage()
    copies = [timed(stage)[0] for _ in range(reps)]
    out["stage_copy_s"] = [round(t, 4) for t in copies]
    out["stage_copy_GBps"] = round(nbytes / min(copies) / 1e9, 1)
    out["stage_copy_equal"] = all(torch.equal(a, b) for a, b in zip(staged, srcs, strict=True))
    out["gpu"] = torch.cuda.get_device_name(0)
    out["torch"] = torch.__version__
    try:
        import triton  # type: ignore[import-not-found, unused-ignore]

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kernels", description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    res = measure()
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res), flush=True)
    ok = res["equal_triton_torch"] and res["equal_numpy_small"] and res["stage_copy_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
