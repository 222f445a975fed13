"""Exact per-parameter checksums of weights, on raw bits, the same on every side.

A sender (the NCCL transports while they send, the ``reload`` transport over the checkpoint it
names) and a replica (the worker extension, :mod:`pool.replica_extension`, over its runtime
parameters after the load) compute :class:`Checksum` values per *checkpoint* tensor name; the
cycle runner compares them (:meth:`pool.evidence.ChecksumEvidence.compare`) and a replica is
published only if every one is equal.

**Definition.** A tensor's bytes in C order are read as little-endian signed 16-bit words
``w_0 .. w_{n-1}`` (a dtype of one byte: each byte is one signed word). Then::

    plain    = sum(w_i)
    weighted = sum(w_i * ((i mod 65521) + 1))

both exact integers (no overflow below 2**32 words per tensor: 64-bit accumulators). Equal
checksums with equal dtype and shape mean equal bits except for an error that cancels in both
sums at once (e.g. two words swapped exactly 65521 positions apart); any single changed bit, a
tensor left on the old weights, or a shifted slice changes them. It is not a cryptographic hash:
it defends against transfer and loading faults, not against an adversary.

**Backends**, all exact and equal by construction (tests compare them):

* :func:`words_checksum` — numpy over a bytes-like object (no torch: the ``reload`` sender reads
  checkpoint bytes straight from the safetensors files);
* :func:`tensor_checksums` with a CUDA tensor — a fused Triton reduction (one read of the
  tensor, per-block partial sums), falling back to torch ops when Triton is missing;
* :func:`tensor_checksums` with a CPU tensor — numpy over the tensor's memory.

``torch``, ``triton`` and ``numpy`` are imported on first use, never at module load (nor
pydantic): the worker extension imports this module inside vLLM's worker, the updater on
machines without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

__all__ = [
    "MODULUS",
    "Checksum",
    "Pending",
    "from_json",
    "tensor_checksums",
    "to_json",
    "words_checksum",
]

MODULUS = 65521  # the largest prime below 2**16: position weights are 1..65521
_TORCH_CHUNK_ROWS = 256  # rows of MODULUS words per step of the torch fallback (134 MB int64)
_TRITON_BLOCK = 16384  # words per Triton program (<= MODULUS: one conditional subtract)


@dataclass(frozen=True)
class Checksum:
    """The checksum of one tensor: its dtype name, shape and the two sums."""

    dtype: str
    shape: tuple[int, ...]
    plain: int
    weighted: int

    def to_json(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.plain, self.weighted]

    @classmethod
    def from_json(cls, raw: Any) -> Checksum:
        """Parse ``[dtype, shape, plain, weighted]``; ``ValueError`` for anything else."""
        try:
            dtype, shape, plain, weighted = raw
            return cls(str(dtype), tuple(int(d) for d in shape), int(plain), int(weighted))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a checksum: {raw!r}") from e


def to_json(sums: Mapping[str, Checksum]) -> dict[str, list[Any]]:
    return {name: c.to_json() for name, c in sums.items()}


def from_json(raw: Any) -> dict[str, Checksum]:
    """Parse ``{name: [dtype, shape, plain, weighted]}``; ``ValueError`` for anything else."""
    if not isinstance(raw, dict):
        raise ValueError(f"checksums must be an object, got {type(raw).__name__}")
    return {str(name): Checksum.from_json(v) for name, v in raw.items()}


# ------------------------------------------------------------------------------ numpy


def _np() -> Any:
    return importlib.import_module("numpy")


def words_checksum(data: Any, itemsize: int) -> tuple[int, int]:
    """``(plain, weighted)`` of a bytes-like object (or a 1-D numpy array of words) holding a
    tensor of ``itemsize``-byte elements (see the module's definition)."""
    np = _np()
    words = np.frombuffer(data, dtype="<i2" if itemsize > 1 else "i1")
    return _np_sums(np, words)


def _np_sums(np: Any, words: Any) -> tuple[int, int]:
    n = int(words.shape[0])
    full = n - n % MODULUS
    cols = np.zeros(MODULUS, dtype=np.int64)
    if full:
        cols += words[:full].reshape(-1, MODULUS).sum(axis=0, dtype=np.int64)
    tail = words[full:]
    cols[: tail.shape[0]] += tail
    weights = np.arange(1, MODULUS + 1, dtype=np.int64)
    return int(cols.sum()), int((cols * weights).sum())


# ------------------------------------------------------------------------------ torch


def _torch() -> Any:
    return importlib.import_module("torch")


def _words(torch: Any, t: Any) -> Any:
    """The tensor's bytes as a flat tensor of signed words (a view when it is contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() == 1:
        return flat.view(torch.int8)
    return flat.view(torch.int16)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def tensor_checksums(
    named: Iterable[tuple[str, Any]], *, stream: Any = None, use_triton: bool | None = None
) -> dict[str, Checksum]:
    """Checksums of ``(name, tensor)`` pairs (torch tensors, CPU or CUDA). On CUDA the kernels
    are queued on ``stream`` (default: the current stream) and read back with one host sync at
    the end; the caller must keep the tensors unchanged until this returns. ``use_triton``:
    None = Triton when importable, else torch ops."""
    torch = _torch()
    pending = Pending(use_triton)
    ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
    with ctx:
        for name, t in named:
            pending.add(name, t)
        return pending.collect()


class Pending:
    """Checksums queued tensor by tensor (:meth:`add`, which only launches kernels on the
    current CUDA stream), read back by :meth:`collect` (one host sync). Lets a receiver
    checksum each tensor right after it landed, on a stream of its own."""

    def __init__(self, use_triton: bool | None = None) -> None:
        self.use_triton = use_triton
        self._meta: list[tuple[str, str, tuple[int, ...]]] = []
        self._parts: list[Any] = []  # per tensor: a (2,) int64 device tensor, or a host tuple

    def add(self, name: str, t: Any) -> None:
        torch = _torch()
        self._meta.append((name, _dtype_name(t.dtype), tuple(int(d) for d in t.shape)))
        words = _words(torch, t)
        if words.device.type == "cpu":
            self._parts.append(_np_sums(_np(), words.numpy()))
        else:
            self._parts.append(_device_sums(torch, words, self.use_triton))

    def collect(self) -> dict[str, Checksum]:
        """The checksums of everything added (waits for the kernels of the current stream)."""
        torch = _torch()
        device = [p for p in self._parts if not isinstance(p, tuple)]
        host = iter(torch.stack(device).cpu().tolist()) if device else iter(())
        out: dict[str, Checksum] = {}
        for (name, dtype, shape), p in zip(self._meta, self._parts, strict=True):
            plain, weighted = p if isinstance(p, tuple) else next(host)
            out[name] = Checksum(dtype, shape, int(plain), int(weighted))
        return out


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _device_sums(torch: Any, words: Any, use_triton: bool | None) -> Any:
    """``(plain, weighted)`` of a device tensor of words, as a (2,) int64 device tensor."""
    if words.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    if use_triton is not False:
        kernel = _triton_kernel()
        if kernel is not None:
            return kernel(words)
        if use_triton:
            raise RuntimeError("Triton is not importable here")
    return _torch_sums(torch, words)


def _torch_sums(torch: Any, words: Any) -> Any:
    """Column sums over rows of MODULUS words, ``_TORCH_CHUNK_ROWS`` rows at a time."""
    n = words.numel()
    full = n - n % MODULUS
    cols = torch.zeros(MODULUS, dtype=torch.int64, device=words.device)
    rows = words[:full].view(-1, MODULUS)
    for r in range(0, rows.shape[0], _TORCH_CHUNK_ROWS):
        cols += rows[r : r + _TORCH_CHUNK_ROWS].to(torch.int64).sum(dim=0)
    tail = words[full:]
    cols[: tail.numel()] += tail.to(torch.int64)
    weights = torch.arange(1, MODULUS + 1, dtype=torch.int64, device=words.device)
    return torch.stack([cols.sum(), (cols * weights).sum()])


# ------------------------------------------------------------------------------ triton

_TRITON: dict[str, Any] = {}


def _triton_kernel() -> Any:
    """``words -> (2,) int64 tensor`` by the fused Triton reduction
    (:mod:`pool.checksum_triton`), or None when Triton cannot be imported. Resolved once."""
    if "fn" not in _TRITON:
        try:
            mod = importlib.import_module("pool.checksum_triton")
        except ImportError:
            _TRITON["fn"] = None
        else:
            _TRITON["fn"] = lambda words: mod.partial_sums(words, _TRITON_BLOCK, MODULUS)
    return _TRITON["fn"]
