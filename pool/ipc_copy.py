"""The replica's side of ``ipc_direct``: copy a staged copy into the runtime parameters.

Used by :meth:`pool.replica_extension.WeightExtension.rolloutpool_ipc_copy`; kept apart so the
copy plan runs (and is unit-tested) on CPU tensors, the CUDA IPC part being only where the
source buffer comes from (:mod:`pool.ipc_handles`).

**Plan.** Each :class:`~pool.ipc_handles.Entry` of the staging buffer lands in its runtime
:class:`~pool.shards.Piece` (resolved by the extension before anything is written). Consecutive
entries that are consecutive both in the buffer and in one runtime parameter (the q/k/v blocks
of a fused ``qkv_proj``, gate/up of ``gate_up_proj``, when the sender laid them out in that
order) become one :class:`Copy` of their bytes, so a transfer is about one device-to-device
copy per runtime parameter. A tensor-parallel rank's slice is copied from the full staged
tensor (a strided copy). :class:`Prepared` binds a plan to one opened buffer: every
(destination, source) view and the checksum batch are built once, and the extension reuses it
for every transfer from that buffer while the runtime parameters stay where they are.

**A transfer** (:meth:`Prepared.run`) queues every copy on the current stream (no host sync
between them), then the checksums of every piece (:class:`Sums`), then waits once. The
checksums are computed over the runtime views after the copies (what the replica serves,
where it serves it: a piece landed in the wrong place, or a bit changed in the staged copy,
changes its checksum), not over the source.

**Checksums** (:class:`Sums`, the definition of :mod:`pool.checksum`): on CUDA, every piece of
16-bit words at a 16-byte aligned address in one launch of the batched Triton kernel
(:mod:`pool.ipc_sums`) and one fold; the kernel is trusted only after it reproduced
:mod:`pool.checksum` exactly on test tensors in this process (:func:`batched_kernel`), else
(or without Triton, or for other pieces) per piece by :class:`pool.checksum.Pending`. On CPU
(tests) per piece with numpy.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from pool.checksum import MODULUS, Checksum, Pending, tensor_checksums, to_json
from pool.ipc_handles import Entry
from pool.shards import Piece

__all__ = ["BLOCK", "Copy", "Prepared", "Sums", "batched_kernel", "block_table", "plan"]


def _torch() -> Any:
    return importlib.import_module("torch")


@dataclass
class Copy:
    """One copy: ``entries`` (consecutive in the buffer) into ``pieces`` (their landing
    places; consecutive in one parameter when there are several)."""

    entries: list[Entry]
    pieces: list[Piece]
    names: list[str] = field(default_factory=list)  # checksum names, one per piece

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def views(self, buffer: Any) -> tuple[Any, Any]:
        """``(destination, source)``: ``destination.copy_(source)`` is this copy."""
        first, piece = self.entries[0], self.pieces[0]
        if piece.slice is not None:
            return piece.view, piece.source(first.view(buffer))
        torch = _torch()
        dst = piece.view.reshape(-1).view(torch.uint8)
        if len(self.pieces) > 1:  # consecutive in one storage: extend over the others
            dst = dst.as_strided((self.nbytes,), (1,))
        return dst, buffer[first.offset : first.offset + self.nbytes]


def _bytes(piece: Piece) -> int:
    v = piece.view
    return int(v.numel()) * int(v.element_size())


def _follows(a: tuple[Entry, Piece], b: tuple[Entry, Piece]) -> bool:
    """``b`` lies right after ``a`` in the buffer and in the same runtime storage."""
    (ea, pa), (eb, pb) = a, b
    if pa.slice is not None or pb.slice is not None:
        return False
    if eb.offset != ea.offset + ea.nbytes or ea.nbytes != _bytes(pa):
        return False
    va, vb = pa.view, pb.view
    if va.device != vb.device or va.dtype != vb.dtype:
        return False
    same = va.untyped_storage().data_ptr() == vb.untyped_storage().data_ptr()
    return bool(same and vb.data_ptr() == va.data_ptr() + ea.nbytes)


def plan(entries: list[Entry], pieces: list[Piece], names: list[str]) -> list[Copy]:
    """The copies of ``entries`` into ``pieces`` (same order), merged as the module docstring
    says; ``names`` are the checksum names of the pieces."""
    out: list[Copy] = []
    for e, p, n in zip(entries, pieces, names, strict=True):
        last = out[-1] if out else None
        if last is not None and _follows((last.entries[-1], last.pieces[-1]), (e, p)):
            last.entries.append(e)
            last.pieces.append(p)
            last.names.append(n)
        else:
            out.append(Copy([e], [p], [n]))
    return out


# ------------------------------------------------------------------------------ checksums

BLOCK = 16384  #: words per program of the batched kernel (<= MODULUS, a multiple of 16)
_KERNEL: dict[str, Any] = {}


def batched_kernel(device: Any) -> tuple[Any, str]:
    """:func:`pool.ipc_sums.batched_sums` once it reproduced :func:`pool.checksum.
    tensor_checksums` bit for bit on test tensors on ``device`` (odd lengths, partial blocks,
    a view into a larger allocation): ``(fn, "")``, else ``(None, why)``. Decided once per
    process (the first call compiles the kernel)."""
    if "fn" in _KERNEL:
        return _KERNEL["fn"], _KERNEL["why"]
    fn, why = None, ""
    try:
        mod = importlib.import_module("pool.ipc_sums")
        torch = _torch()
        g = torch.Generator(device=device).manual_seed(30)
        n = 3 * BLOCK + 40
        big = torch.randint(-(2**15), 2**15, (n,), generator=g, device=device)
        big = big.to(torch.int16)
        tests = [big[:1], big[8 : 8 + BLOCK], big[16 : 16 + 2 * BLOCK + 3], big]
        tests.append(torch.randn(7, 9, generator=g, device=device).bfloat16())
        table = _table([t.view(torch.int16) for t in tests])
        rows = mod.batched_sums(*table, BLOCK, MODULUS).cpu().tolist()
        want = tensor_checksums((str(i), t) for i, t in enumerate(tests))
        bad = [i for i, t in enumerate(want.values()) if [t.plain, t.weighted] != rows[i]]
        fn, why = (mod.batched_sums, "") if not bad else (None, f"self-test differs: {bad}")
    except Exception as e:  # no Triton, a compile error: the per-piece kernels stay
        why = f"{type(e).__name__}: {e}"[:300]
    _KERNEL.update(fn=fn, why=why)
    return fn, why


def block_table(nwords: list[int], block: int) -> tuple[list[int], list[int]]:
    """``(seg, start)`` of :mod:`pool.ipc_sums`: one entry per block of ``block`` words of
    each tensor of ``nwords`` words, in order (an empty tensor has no block)."""
    seg: list[int] = []
    start: list[int] = []
    for i, n in enumerate(nwords):
        k = -(-n // block)
        seg.extend([i] * k)
        start.extend(range(0, k * block, block))
    return seg, start


def _table(words: list[Any]) -> tuple[Any, Any, Any, Any]:
    """The arguments of :func:`pool.ipc_sums.batched_sums` for ``words`` (flat int16 tensors
    on one device, 16-byte aligned): addresses, block table, lengths."""
    torch = _torch()
    seg, start = block_table([int(w.numel()) for w in words], BLOCK)
    i64 = {"dtype": torch.int64, "device": words[0].device}
    return (
        torch.tensor([int(w.data_ptr()) for w in words], **i64),
        torch.tensor(seg, **i64),
        torch.tensor(start, **i64),
        torch.tensor([int(w.numel()) for w in words], **i64),
    )


def _dtype_name(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


class Sums:
    """The checksums of fixed tensors (``(name, view)`` pairs that stay where they are and are
    re-read on every :meth:`launch`), batched as the module docstring says. The block table
    is built once, here."""

    def __init__(self, named: list[tuple[str, Any]]) -> None:
        torch = _torch()
        self.named = named
        self.kernel = "cpu"
        self.why = ""
        self._batched: list[int] = []  # indices into named, in the table's order
        self._rest = list(named)  # the pieces checksummed one by one
        self._fn: Any = None
        self._table: tuple[Any, ...] | None = None
        device = named[0][1].device if named else None
        if device is None or device.type != "cuda":
            return
        fn, self.why = batched_kernel(device)
        self.kernel = "per_piece"
        if fn is None:
            return
        words = []
        for i, (_, t) in enumerate(named):
            if t.element_size() > 1 and t.is_contiguous() and t.data_ptr() % 16 == 0:
                self._batched.append(i)
                words.append(t.reshape(-1).view(torch.int16))
        if not words:
            return
        self._fn = fn
        self._table = _table(words)
        kept = set(self._batched)
        self._rest = [nt for i, nt in enumerate(named) if i not in kept]
        self.kernel = "batched" if len(words) == len(named) else "batched+per_piece"

    def launch(self) -> tuple[Any, Pending]:
        """Queue every checksum on the current stream (CPU: compute them); pass the result
        to :meth:`collect`."""
        rows = None
        if self._table is not None:
            rows = self._fn(*self._table, BLOCK, MODULUS)
        rest = Pending()
        for name, t in self._rest:
            rest.add(name, t)
        return rows, rest

    def collect(self, launched: tuple[Any, Pending]) -> dict[str, Checksum]:
        """The checksums of :meth:`launch` by name (waits for the current stream)."""
        rows, rest = launched
        out = rest.collect()
        if rows is not None:
            for i, (plain, weighted) in zip(self._batched, rows.cpu().tolist(), strict=True):
                name, t = self.named[i]
                out[name] = Checksum(
                    _dtype_name(t), tuple(int(d) for d in t.shape), plain, weighted
                )
        return {name: out[name] for name, _ in self.named}


# ------------------------------------------------------------------------------ a transfer


class Prepared:
    """``copies`` bound to ``buffer`` (see the module docstring): build once, :meth:`run` per
    transfer. Holds views of the buffer and of the runtime parameters (keeping both alive)."""

    def __init__(self, buffer: Any, copies: list[Copy]) -> None:
        self.buffer = buffer
        self.pairs = [c.views(buffer) for c in copies]
        self.copies = len(copies)
        self.nbytes = sum(c.nbytes for c in copies)
        self.named = [(n, p.view) for c in copies for n, p in zip(c.names, c.pieces, strict=True)]
        self._sums: Sums | None = None

    def sums(self) -> Sums:
        """The checksum batch of every piece (built on first use)."""
        if self._sums is None:
            self._sums = Sums(self.named)
        return self._sums

    def run(self, *, checksums: bool) -> dict[str, Any]:
        """Copy everything (no autograd), then checksum every piece (``checksums``), and wait.
        Returns ``copies``, ``bytes``, ``queue_s`` (host time to queue it all), ``run_s``
        (from the first copy queued to the last result on the host), on CUDA ``copy_gpu_s``
        and ``checksum_gpu_s`` (device time between events), and with ``checksums``
        ``"checksums"`` (:func:`~pool.checksum.to_json`) and ``checksum_kernel``."""
        torch = _torch()
        cuda = self.buffer.device.type == "cuda"
        sums = self.sums() if checksums else None
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        t0 = time.perf_counter()
        with torch.no_grad():
            if events:
                events[0].record()
            for dst, src in self.pairs:
                dst.copy_(src)
            if events:
                events[1].record()
            launched = sums.launch() if sums is not None else None
            if events:
                events[2].record()
        queue_s = time.perf_counter() - t0
        got = sums.collect(launched) if sums is not None and launched is not None else None
        if events:
            events[2].synchronize()
        out: dict[str, Any] = {
            "copies": self.copies,
            "bytes": self.nbytes,
            "queue_s": queue_s,
            "run_s": time.perf_counter() - t0,
        }
        if events:
            out["copy_gpu_s"] = events[0].elapsed_time(events[1]) / 1e3
            out["checksum_gpu_s"] = events[1].elapsed_time(events[2]) / 1e3
        if sums is not None and got is not None:
            out["checksums"] = to_json(got)
            out["checksum_kernel"] = sums.kernel
            if sums.why:
                out["checksum_kernel_why"] = sums.why
        return out
