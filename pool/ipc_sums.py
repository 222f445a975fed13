"""Checksums of many tensors in one launch (Triton), for the replica's side of ``ipc_direct``.

:mod:`pool.checksum_triton` reduces one tensor per launch; a replica that checksums the ~400
runtime views of an 8B model after copying them pays ~400 launches from Python for that.
This kernel computes the same per-block partial sums (plain, and weighted by
``(position mod MOD) + 1``, positions counted from each tensor's first word) for every block
of every tensor in one launch, from a block table built once per set of tensors
(:func:`pool.ipc_copy.block_table`): block ``b`` reads tensor ``seg[b]`` (its address
``addrs[seg[b]]``, its length ``nwords[seg[b]]`` words) from word ``start[b]`` on. One
``index_add_`` folds the partials into one ``(plain, weighted)`` row per tensor.
:mod:`pool.ipc_copy` builds the table and trusts this kernel only after it reproduced
:mod:`pool.checksum` in the same process.

Contract of the table: every tensor is a contiguous run of 16-bit words starting at a 16-byte
aligned address (the kernel's loads are vectorized on that promise), ``start`` is a multiple
of ``BLOCK`` below the tensor's length, and ``BLOCK`` <= ``MOD``. Kept in its own module
because Triton reads the kernel's source and annotations (so no postponed annotations here).
"""

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

__all__ = ["batched_sums"]


@triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
def _multi_partials(  # type: ignore[no-untyped-def]
    addr_ptr, seg_ptr, start_ptr, n_ptr, out_ptr, BLOCK: tl.constexpr, MOD: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    seg = tl.load(seg_ptr + pid)
    start = tl.multiple_of(tl.load(start_ptr + pid), 16)
    n = tl.load(n_ptr + seg)
    base = tl.multiple_of(tl.load(addr_ptr + seg).to(tl.pointer_type(tl.int16)), 16)
    j = tl.arange(0, BLOCK)
    offs = start + j
    if start + BLOCK <= n:  # a full block: unmasked, vectorized loads
        x = tl.load(base + offs).to(tl.int64)
    else:
        x = tl.load(base + offs, mask=offs < n, other=0).to(tl.int64)
    r = (start % MOD).to(tl.int32) + j  # < 2 * MOD because BLOCK <= MOD
    w = tl.where(r >= MOD, r - MOD, r).to(tl.int64) + 1
    tl.store(out_ptr + 2 * pid, tl.sum(x, axis=0))
    tl.store(out_ptr + 2 * pid + 1, tl.sum(x * w, axis=0))


def batched_sums(
    addrs: torch.Tensor,
    seg: torch.Tensor,
    start: torch.Tensor,
    nwords: torch.Tensor,
    block: int,
    modulus: int,
) -> torch.Tensor:
    """``(tensors, 2)`` int64 ``(plain, weighted)`` of the tensors the table describes (all
    four int64 tensors on the tensors' device; see the module docstring), queued on the
    current stream (no host sync)."""
    if block > modulus or block % 16:
        raise ValueError("block must be a multiple of 16 that does not exceed the modulus")
    out = torch.empty((seg.numel(), 2), dtype=torch.int64, device=addrs.device)
    if seg.numel():
        _multi_partials[(seg.numel(),)](addrs, seg, start, nwords, out, BLOCK=block, MOD=modulus)
    sums = torch.zeros((nwords.numel(), 2), dtype=torch.int64, device=addrs.device)
    return sums.index_add_(0, seg, out)
