"""Checksums of many tensors in one launch (Triton), copying them on the way where asked, for
the replica's side of ``ipc_direct``.

:mod:`pool.checksum_triton` reduces one tensor per launch; a replica that checksums the ~400
runtime views of an 8B model after copying them pays ~400 launches from Python for that. These
kernels compute the same per-block partial sums (plain, and weighted by ``(position mod MOD) +
1``, positions counted from each tensor's first word) for every block of every tensor in one
launch, from a block table built once per set of tensors (:func:`pool.ipc_copy.block_table`):
block ``b`` reads tensor ``seg[b]`` (its address ``src[seg[b]]``, its length ``nwords[seg[b]]``
words) from word ``start[b]`` on. One ``index_add_`` folds the partials into one ``(plain,
weighted)`` row per tensor.

* :func:`batched_sums` only reads.
* :func:`copy_sums` also writes every word it read to the same position of ``dst[seg[b]]``:
  the copy and its checksums in one pass over the source (the sums are those of the words
  written).

**Exact and cheap.** Per word the kernels do 32-bit integer work only: a block is read as rows
of :data:`COLS` words; per row the plain sum and the sum of ``word * column`` fit 32 bits (|word|
<= 2**15, column < 128, at most 4096 words per sub-block), and so does the plain sum of the
words past the one place where the position weight wraps (``SUB <= MOD``; only the sub-blocks
that hold that place pay for it); the 64-bit weighted sum is assembled from those per row.
(64-bit multiplies per word made the reduction compute-bound, not memory-bound, on an H200.)

Contract of the table: every tensor is a contiguous run of 16-bit words starting at a 16-byte
aligned address (the loads and stores are vectorized on that promise), ``start`` is a multiple
of ``BLOCK`` below the tensor's length, ``BLOCK`` is a multiple of :data:`SUB` and
``BLOCK <= MOD``; for :func:`copy_sums` no destination overlaps a source or another
destination. :mod:`pool.ipc_copy` builds the table and trusts a kernel only after it
reproduced :mod:`pool.checksum` (and, copying, the source's bits) in the same process. Kept in
its own module because Triton reads the kernels' source and annotations (so no postponed
annotations here).
"""

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

__all__ = ["COLS", "SUB", "batched_sums", "copy_sums"]

COLS = 128  #: words per row of a sub-block
SUB = 4096  #: words per sub-block (32 rows): the unit of one vectorized load


@triton.jit  # type: ignore[misc, untyped-decorator, unused-ignore]
def _partials(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    seg_ptr,
    start_ptr,
    n_ptr,
    out_ptr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    COLS: tl.constexpr,
    MOD: tl.constexpr,
    COPY: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    seg = tl.load(seg_ptr + pid)
    start = tl.multiple_of(tl.load(start_ptr + pid), 16)
    n = tl.load(n_ptr + seg)
    src = tl.multiple_of(tl.load(src_ptr + seg).to(tl.pointer_type(tl.int16)), 16)
    dst = src
    if COPY:
        dst = tl.multiple_of(tl.load(dst_ptr + seg).to(tl.pointer_type(tl.int16)), 16)
    rows = tl.arange(0, SUB // COLS)
    cols = tl.arange(0, COLS)
    j = rows[:, None] * COLS + cols[None, :]  # position in the sub-block, int32
    row_base = (rows * COLS).to(tl.int64)
    plain = tl.zeros((1,), dtype=tl.int64)
    weighted = tl.zeros((1,), dtype=tl.int64)
    for k in tl.static_range(BLOCK // SUB):
        s = start + k * SUB
        offs = s + j
        if s + SUB <= n:  # a full sub-block: unmasked, vectorized
            x = tl.load(src + offs)
            if COPY:
                tl.store(dst + offs, x)
        else:
            x = tl.load(src + offs, mask=offs < n, other=0)
            if COPY:
                tl.store(dst + offs, x, mask=offs < n)
        x32 = x.to(tl.int32)
        r0 = (s % MOD).to(tl.int32)  # the weight of word 0 is r0 + 1
        row_plain = tl.sum(x32, axis=1)  # |.| <= 2**22
        row_cols = tl.sum(x32 * cols[None, :], axis=1)  # |.| <= 2**29
        total = tl.sum(row_plain, axis=0)  # |.| <= 2**27
        w = tl.sum(row_base * row_plain.to(tl.int64) + row_cols.to(tl.int64), axis=0)
        plain += total.to(tl.int64)
        weighted += w + (r0 + 1).to(tl.int64) * total.to(tl.int64)
        if r0 + SUB > MOD:  # the weight wraps inside this sub-block (once: SUB <= MOD)
            wrapped = tl.sum(tl.sum(tl.where(j >= MOD - r0, x32, 0), axis=1), axis=0)
            weighted -= MOD * wrapped.to(tl.int64)
    two = tl.arange(0, 1)
    tl.store(out_ptr + 2 * pid + two, plain)
    tl.store(out_ptr + 2 * pid + 1 + two, weighted)


def _run(
    src: torch.Tensor,
    dst: torch.Tensor | None,
    seg: torch.Tensor,
    start: torch.Tensor,
    nwords: torch.Tensor,
    block: int,
    modulus: int,
) -> torch.Tensor:
    if block > modulus or block % SUB:
        raise ValueError(f"block must be a multiple of {SUB} that does not exceed the modulus")
    out = torch.empty((seg.numel(), 2), dtype=torch.int64, device=src.device)
    if seg.numel():
        _partials[(seg.numel(),)](
            src,
            src if dst is None else dst,
            seg,
            start,
            nwords,
            out,
            BLOCK=block,
            SUB=SUB,
            COLS=COLS,
            MOD=modulus,
            COPY=dst is not None,
            num_warps=8,
        )
    sums = torch.zeros((nwords.numel(), 2), dtype=torch.int64, device=src.device)
    return sums.index_add_(0, seg, out)


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
    return _run(addrs, None, seg, start, nwords, block, modulus)


def copy_sums(
    src: torch.Tensor,
    dst: torch.Tensor,
    seg: torch.Tensor,
    start: torch.Tensor,
    nwords: torch.Tensor,
    block: int,
    modulus: int,
) -> torch.Tensor:
    """Copy tensor ``i`` of the table from address ``src[i]`` to ``dst[i]`` and return what
    :func:`batched_sums` returns for the copied words, queued on the current stream."""
    return _run(src, dst, seg, start, nwords, block, modulus)
