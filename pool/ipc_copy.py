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

**A transfer** (:meth:`Prepared.run`) queues everything on the current stream (no host sync
in between), then waits once. Without checksums it is one device-to-device copy per
:class:`Copy`. With them, on CUDA, every piece the copy kernel can move (whole, contiguous,
16-bit words or wider, 16-byte aligned at both ends: every piece of a dense bf16 model on one
GPU) is copied *and* checksummed in one pass, one launch for all of them
(:func:`pool.ipc_sums.copy_sums`): the checksums are those of the words the kernel read
from the staged copy and wrote into the runtime parameters, so a bit changed in the staged copy
or a piece missing changes them. They do not re-read what landed: a write that never reached
the memory the engine serves from is caught by the probe, not by them (seen on an H200 when
the copy ran in a thread of the worker other than vLLM's: checksums equal, probe refused).
The other pieces (a tensor-parallel slice, a one-byte dtype) are copied as
above and checksummed over the runtime views after their copies (:class:`Sums`).

**Checksums** (:class:`Sums`, the definition of :mod:`pool.checksum`): on CUDA, every piece of
16-bit words at a 16-byte aligned address in one launch of the batched Triton kernel
(:mod:`pool.ipc_sums`) and one fold, else (or without Triton, or for other pieces) per piece by
:class:`pool.checksum.Pending`; on CPU (tests) per piece with numpy. Both Triton kernels are
trusted only after they reproduced :mod:`pool.checksum` (the copy kernel also every source bit)
on test tensors in this process (:func:`batched_kernels`).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from pool.checksum import MODULUS, Checksum, Pending, tensor_checksums, to_json
from pool.ipc_handles import Entry
from pool.shards import Piece

__all__ = ["BLOCK", "Copy", "Prepared", "Sums", "batched_kernels", "block_table", "plan"]


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

BLOCK = 16384  #: words per program of the batched kernels (<= MODULUS, a multiple of ipc_sums.SUB)
_KERNELS: dict[str, Any] = {}


def batched_kernels(device: Any) -> tuple[Any, Any, str]:
    """:func:`pool.ipc_sums.batched_sums` and :func:`pool.ipc_sums.copy_sums` once each
    reproduced :func:`pool.checksum.tensor_checksums` bit for bit on test tensors on ``device``
    (odd lengths, partial blocks, a view into a larger allocation, a tensor past the position
    weights' wrap), the copy also every source bit: ``(sums, copy, "")``, else ``None`` for a
    kernel that did not, and why. Decided once per process (the first call compiles them)."""
    if "sums" in _KERNELS:
        return _KERNELS["sums"], _KERNELS["copy"], _KERNELS["why"]
    sums_fn, copy_fn, why = None, None, ""
    try:
        mod = importlib.import_module("pool.ipc_sums")
        torch = _torch()
        g = torch.Generator(device=device).manual_seed(30)
        n = 3 * BLOCK + 40
        big = torch.randint(-(2**15), 2**15, (n,), generator=g, device=device)
        big = big.to(torch.int16)
        tests = [big[:1], big[8 : 8 + BLOCK], big[16 : 16 + 2 * BLOCK + 3], big]
        tests.append(torch.randn(7, 9, generator=g, device=device).bfloat16())
        wraps = torch.randint(-(2**15), 2**15, (2 * MODULUS + 77,), generator=g, device=device)
        tests.append(wraps.to(torch.int16))
        words = [t.view(torch.int16).reshape(-1) for t in tests]
        src, seg, start, nwords = _table(words)
        want = [[c.plain, c.weighted] for c in tensor_checksums(_named(tests)).values()]
        rows = mod.batched_sums(src, seg, start, nwords, BLOCK, MODULUS).cpu().tolist()
        bad = [i for i, r in enumerate(rows) if r != want[i]]
        sums_fn, why = (mod.batched_sums, "") if not bad else (None, f"sums differ: {bad}")
        dsts = [torch.zeros_like(w) for w in words]
        dst = torch.tensor([int(d.data_ptr()) for d in dsts], dtype=torch.int64, device=device)
        rows = mod.copy_sums(src, dst, seg, start, nwords, BLOCK, MODULUS).cpu().tolist()
        bad = [
            i
            for i, (r, d, w) in enumerate(zip(rows, dsts, words, strict=True))
            if r != want[i] or not torch.equal(d, w)
        ]
        if not bad:
            copy_fn = mod.copy_sums
        else:
            why = f"{why}; copy differs: {bad}".lstrip("; ")
    except Exception as e:  # no Triton, a compile error: the per-piece kernels stay
        why = f"{type(e).__name__}: {e}"[:300]
    _KERNELS.update(sums=sums_fn, copy=copy_fn, why=why)
    return sums_fn, copy_fn, why


def _named(tensors: list[Any]) -> list[tuple[str, Any]]:
    return [(str(i), t) for i, t in enumerate(tensors)]


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
    i64 = _i64(words[0].device)
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
        fn, _, self.why = batched_kernels(device)
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


def _fusable(entry: Entry, piece: Piece, buffer: Any) -> bool:
    """Whether the copy kernel can move ``entry`` into ``piece`` (whole, contiguous, 16-bit
    words or wider, both ends 16-byte aligned)."""
    dst = piece.view
    return (
        piece.slice is None
        and dst.is_contiguous()
        and dst.element_size() >= 2
        and entry.nbytes == _bytes(piece)
        and entry.nbytes % 2 == 0
        and int(dst.data_ptr()) % 16 == 0
        and (int(buffer.data_ptr()) + entry.offset) % 16 == 0
    )


class _Fused:
    """The pieces the copy kernel moves and checksums in one launch (table built once)."""

    def __init__(self, fn: Any, triples: list[tuple[str, Any, Any]]) -> None:
        torch = _torch()
        self.fn = fn
        self.named = [(name, dst) for name, dst, _ in triples]
        src = [s.reshape(-1).view(torch.int16) for _, _, s in triples]
        dst = [d.reshape(-1).view(torch.int16) for _, d, _ in triples]
        self.src, self.seg, self.start, self.nwords = _table(src)
        self.dst = torch.tensor([int(d.data_ptr()) for d in dst], **_i64(dst[0].device))

    def launch(self) -> Any:
        return self.fn(self.src, self.dst, self.seg, self.start, self.nwords, BLOCK, MODULUS)

    def collect(self, rows: Any) -> dict[str, Checksum]:
        out: dict[str, Checksum] = {}
        for (name, t), (plain, weighted) in zip(self.named, rows.cpu().tolist(), strict=True):
            out[name] = Checksum(_dtype_name(t), tuple(int(d) for d in t.shape), plain, weighted)
        return out


def _i64(device: Any) -> dict[str, Any]:
    return {"dtype": _torch().int64, "device": device}


class Prepared:
    """``copies`` bound to ``buffer`` (see the module docstring): build once, :meth:`run` per
    transfer. Holds views of the buffer and of the runtime parameters (keeping both alive)."""

    def __init__(self, buffer: Any, copies: list[Copy]) -> None:
        self.buffer = buffer
        self.copies = len(copies)
        self.nbytes = sum(c.nbytes for c in copies)
        self.named = [(n, p.view) for c in copies for n, p in zip(c.names, c.pieces, strict=True)]
        self._all = copies
        self._checked: tuple[_Fused | None, list[tuple[Any, Any]], Sums] | None = None
        self._pairs: list[tuple[Any, Any]] | None = None

    def _plain(self) -> list[tuple[Any, Any]]:
        """Every copy as ``(destination, source)`` (a transfer without checksums)."""
        if self._pairs is None:
            self._pairs = [c.views(self.buffer) for c in self._all]
        return self._pairs

    def _with_sums(self) -> tuple[_Fused | None, list[tuple[Any, Any]], Sums]:
        """A transfer with checksums: the copy kernel's part (every copy whose pieces it can
        move, on CUDA, once it passed its self-test), the other copies, and the checksum batch
        of their pieces (built on first use)."""
        if self._checked is None:
            fn = None
            if self.buffer.device.type == "cuda":
                _, fn, _ = batched_kernels(self.buffer.device)
            fused: list[tuple[str, Any, Any]] = []
            rest: list[Copy] = []
            for c in self._all:
                pairs = list(zip(c.entries, c.pieces, strict=True))
                if fn is not None and all(_fusable(e, p, self.buffer) for e, p in pairs):
                    fused += [
                        (n, p.view, e.view(self.buffer))
                        for (e, p), n in zip(pairs, c.names, strict=True)
                    ]
                else:
                    rest.append(c)
            others = [(n, p.view) for c in rest for n, p in zip(c.names, c.pieces, strict=True)]
            self._checked = (
                _Fused(fn, fused) if fused else None,
                [c.views(self.buffer) for c in rest],
                Sums(others),
            )
        return self._checked

    def run(self, *, checksums: bool) -> dict[str, Any]:
        """Copy everything (no autograd) and, with ``checksums``, checksum every piece, then
        wait. Returns ``copies``, ``bytes``, ``queue_s`` (host time to queue it all), ``run_s``
        (from the first copy queued to the last result on the host), on CUDA ``copy_gpu_s``
        (the copies, with the checksums the copy kernel computes on the way) and
        ``checksum_gpu_s`` (the other pieces' checksums: device time between events), and with
        ``checksums`` ``"checksums"`` (:func:`~pool.checksum.to_json`), ``checksum_kernel``
        and ``fused`` (pieces copied and checksummed in one pass)."""
        torch = _torch()
        cuda = self.buffer.device.type == "cuda"
        fused, pairs, sums = self._with_sums() if checksums else (None, self._plain(), None)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        t0 = time.perf_counter()
        with torch.no_grad():
            if events:
                events[0].record()
            rows = fused.launch() if fused is not None else None
            for dst, src in pairs:
                dst.copy_(src)
            if events:
                events[1].record()
            launched = sums.launch() if sums is not None else None
            if events:
                events[2].record()
        queue_s = time.perf_counter() - t0
        got = sums.collect(launched) if sums is not None and launched is not None else None
        if got is not None and fused is not None:
            got.update(fused.collect(rows))
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
            out["checksums"] = to_json({name: got[name] for name, _ in self.named})
            kernels = ([] if fused is None else ["copy"]) + ([sums.kernel] if sums.named else [])
            out["checksum_kernel"] = "+".join(kernels) or sums.kernel
            out["fused"] = 0 if fused is None else len(fused.named)
            if sums.why:
                out["checksum_kernel_why"] = sums.why
        return out
