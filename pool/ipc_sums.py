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

**Exact and cheap.** Per word the kernels do 32-bit integer work only, in registers, and
reduce across threads once per block: a block is read as ``BLOCK // SUB`` sub-blocks of
:data:`SUB` words (one vectorized load each); per position ``j`` of a sub-block they keep the
plain sum ``p[j]`` of the words at ``j`` in every sub-block ``k``, the sum ``a[j]`` of ``k * word``
and the sum ``q[j]`` of the words at or past the one place in the block where the position
weight wraps (``BLOCK <= MOD``). With ``r0`` the block's first position mod ``MOD``, the block's
weighted sum is ``(r0 + 1) * sum(p) + SUB * sum(a) + sum(j * p[j]) - MOD * sum(q)``, the four
sums taken in 64 bits. |word| <= 2**15 and at most 16 sub-blocks per block keep ``p``, ``a``
and ``q`` inside 32 bits. (Reducing every row of every sub-block across threads makes the kernel
compute-bound. This one copies and checksums the 8B shape at 1,424 GB/s on an H200, where the
copy engine alone copies at 1,905: ``bench/results/gpu_update.json``, ``breakdown``.)

Contract of the table: every tensor is a contiguous run of 16-bit words starting at a 16-byte
aligned address (the loads and stores are vectorized on that promise), ``start`` is a multiple
of ``BLOCK`` below the tensor's length, ``BLOCK`` is a multiple of :data:`SUB` (at most 16
times it) and ``BLOCK <= MOD``; for :func:`copy_sums` no destination overlaps a source or another
destination. :mod:`pool.ipc_copy` builds the table and trusts a kernel only after it
reproduced :mod:`pool.checksum` (and, copying, the source's bits) in the same process. Kept in
its own module because Triton reads the kernels' source and annotations (so no postponed
annotations here).
"""

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

__all__ = ["SUB", "batched_sums", "copy_sums"]

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
    j = tl.arange(0, SUB)  # position in the sub-block, int32
    r0 = (start % MOD).to(tl.int32)  # the weight of the block's first word is r0 + 1
    wrap = MOD - r0  # from this offset in the block on, a word's weight is MOD less
    p = tl.zeros((SUB,), dtype=tl.int32)
    a = tl.zeros((SUB,), dtype=tl.int32)
    q = tl.zeros((SUB,), dtype=tl.int32)
    for k in tl.static_range(BLOCK // SUB):
        offs = start + k * SUB + j
        if start + (k + 1) * SUB <= n:  # a full sub-block: unmasked, vectorized
            x = tl.load(src + offs)
            if COPY:
                tl.store(dst + offs, x)
        else:
            x = tl.load(src + offs, mask=offs < n, other=0)
            if COPY:
                tl.store(dst + offs, x, mask=offs < n)
        x32 = x.to(tl.int32)
        p += x32
        if k > 0:
            a += x32 * k
        if wrap < (k + 1) * SUB:  # the wrap is in this sub-block or before it
            q += tl.where(k * SUB + j >= wrap, x32, 0)
    plain = tl.sum(p.to(tl.int64), axis=0)
    weighted = (r0 + 1).to(tl.int64) * plain + SUB * tl.sum(a.to(tl.int64), axis=0)
    weighted += tl.sum(j.to(tl.int64) * p.to(tl.int64), axis=0)
    weighted -= MOD * tl.sum(q.to(tl.int64), axis=0)
    at = tl.arange(0, 1)  # stores take blocks: the two sums as (1,)-shaped values
    tl.store(out_ptr + 2 * pid + at, plain + at * 0)
    tl.store(out_ptr + 2 * pid + 1 + at, weighted + at * 0)


def _run(
    src: torch.Tensor,
    dst: torch.Tensor | None,
    seg: torch.Tensor,
    start: torch.Tensor,
    nwords: torch.Tensor,
    block: int,
    modulus: int,
) -> torch.Tensor:
    if block > modulus or block % SUB or block > 16 * SUB:
        raise ValueError(f"block must be a multiple of {SUB}, at most {16 * SUB} and the modulus")
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
            MOD=modulus,
            COPY=dst is not None,
            num_warps=4,
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
