"""The fused CUDA reduction behind :func:`pool.checksum.tensor_checksums` (Triton).

Imported only where ``triton`` is importable (vLLM's GPU workers, the sending side on a GPU
host), by :mod:`pool.checksum`, which owns the definition this kernel computes: per block of
``BLOCK`` words, the plain sum and the sum weighted by ``(position mod MOD) + 1``, stored as
partials that one ``sum`` folds. Kept in its own module because Triton reads the kernel's source
and annotations (so no postponed annotations here). One read of the tensor, int64 accumulators.
"""

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

__all__ = ["partial_sums"]


@triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
def _partials(x_ptr, n, out_ptr, BLOCK: tl.constexpr, MOD: tl.constexpr):  # type: ignore[no-untyped-def]
    pid = tl.program_id(0).to(tl.int64)
    start = pid * BLOCK
    j = tl.arange(0, BLOCK)
    offs = start + j
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int64)
    r = (start % MOD).to(tl.int32) + j  # < 2 * MOD because BLOCK <= MOD
    w = tl.where(r >= MOD, r - MOD, r).to(tl.int64) + 1
    tl.store(out_ptr + 2 * pid, tl.sum(x, axis=0))
    tl.store(out_ptr + 2 * pid + 1, tl.sum(x * w, axis=0))


def partial_sums(words: torch.Tensor, block: int, modulus: int) -> torch.Tensor:
    """``(plain, weighted)`` of a flat CUDA tensor of int16/int8 words as a (2,) int64 tensor,
    queued on the current stream (no host sync)."""
    if block > modulus:
        raise ValueError("block must not exceed the modulus")
    n = words.numel()
    grid = (n + block - 1) // block
    out = torch.empty((grid, 2), dtype=torch.int64, device=words.device)
    _partials[(grid,)](words, n, out, BLOCK=block, MOD=modulus)
    return out.sum(dim=0)
