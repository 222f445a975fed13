"""CUDA IPC handles of a staging buffer, as JSON: exported by a sender, opened by a replica.

The ``ipc_direct`` transport (:mod:`updater.transports.ipc`) hands each replica one handle per
staging buffer: a flat ``uint8`` CUDA tensor the sender owns, laid out as a header followed by
every tensor to load (:class:`Entry`). The replica's worker extension
(:mod:`pool.replica_extension`) opens the handle once and copies from it on its own GPU.

**The handle** (:class:`IpcHandle`) carries exactly what ``torch.multiprocessing.reductions``
produces for a CUDA tensor (``reduce_tensor``: the CUDA IPC memory handle, the storage's size
and offset, the producer's reference counter and event), as JSON with the byte strings in
base64, plus the *physical* GPU's UUID. Nothing is unpickled on the replica: the classes
``reduce_tensor`` would name are fixed here (a ``uint8`` tensor over a ``TypedStorage``).

**Devices.** CUDA device indices differ between processes (``CUDA_VISIBLE_DEVICES``), so the
handle names its GPU by UUID and the opener resolves it among the devices it sees
(:func:`resolve_device`): the opener's own GPU (the colocated case), another GPU it can reach
by peer access (the same host), or none, which the opener refuses before touching anything.

**The header** (first :data:`HEADER_BYTES` bytes) holds the staged copy's *tag* (a positive
int64 at offset 0, 0 while the sender rewrites the buffer): a replica reads it before and after
its copy (:func:`read_tag`), so a buffer that no longer holds the expected copy is refused
before anything is written, and one rewritten during the copy is detected after it.

``torch`` is imported on first use, never at module load (the updater imports this module on
machines without torch; the worker extension inside vLLM's worker).
"""

from __future__ import annotations

import base64
import importlib
import math
from dataclasses import asdict, dataclass
from typing import Any

from pool.types import DTYPE_BYTES

__all__ = [
    "ALIGN_BYTES",
    "HEADER_BYTES",
    "Entry",
    "IpcHandle",
    "device_uuid",
    "export_buffer",
    "layout",
    "open_buffer",
    "read_tag",
    "resolve_device",
    "write_tag",
]

HEADER_BYTES = 256  #: bytes before the first tensor (the tag at offset 0)
ALIGN_BYTES = 16  #: every tensor starts at a multiple of this offset (16-byte vector loads)


def _torch() -> Any:
    return importlib.import_module("torch")


@dataclass(frozen=True)
class Entry:
    """One tensor in a staging buffer: its name, dtype, shape and byte ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: dtype {self.dtype} cannot be staged")
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_json(cls, raw: Any) -> Entry:
        """Parse ``[name, dtype, shape, offset]``; ``ValueError`` for anything else."""
        try:
            name, dtype, shape, offset = raw
            return cls(str(name), str(dtype), tuple(int(d) for d in shape), int(offset))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a staging entry: {raw!r}") from e

    def view(self, buffer: Any) -> Any:
        """This entry as a typed tensor viewing ``buffer`` (a flat ``uint8`` tensor)."""
        torch = _torch()
        raw = buffer[self.offset : self.offset + self.nbytes]
        return raw.view(getattr(torch, self.dtype)).view(self.shape)


def layout(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[Entry], int]:
    """Entries for ``(name, dtype, shape)`` in this order after the header, each aligned to
    :data:`ALIGN_BYTES`, and the buffer's total size in bytes."""
    out: list[Entry] = []
    offset = HEADER_BYTES
    for name, dtype, shape in specs:
        e = Entry(name, dtype, tuple(int(d) for d in shape), offset)
        out.append(e)
        offset += -(-e.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return out, offset


@dataclass(frozen=True)
class IpcHandle:
    """A staging buffer as another process opens it (see the module docstring)."""

    device_uuid: str
    nbytes: int
    handle: str  # base64 of the CUDA IPC memory handle
    storage_size: int
    storage_offset: int
    tensor_offset: int
    ref_counter_handle: str  # base64
    ref_counter_offset: int
    event_handle: str | None  # base64
    event_sync_required: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> IpcHandle:
        """Parse :meth:`to_json`'s output; ``ValueError`` for anything else."""
        if not isinstance(raw, dict):
            raise ValueError(f"not an IPC handle: {raw!r:.200}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"not an IPC handle: {e}") from e

    @property
    def key(self) -> tuple[str, int, int]:
        """What identifies the exported memory (an opener caches what it opened by this)."""
        return (self.handle, self.storage_offset, self.tensor_offset)


def _b64(raw: Any) -> str:
    return base64.b64encode(bytes(raw)).decode("ascii")


def device_uuid(index: int) -> str:
    """The physical UUID of CUDA device ``index`` of this process."""
    return str(_torch().cuda.get_device_properties(index).uuid)


def export_buffer(buffer: Any) -> IpcHandle:
    """The handle of ``buffer``, a flat contiguous ``uint8`` CUDA tensor the caller keeps
    alive (and does not free or reallocate) while any process may open it."""
    torch = _torch()
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError("a staging buffer is a flat contiguous uint8 tensor")
    if buffer.device.type != "cuda":
        raise ValueError(f"CUDA IPC needs a CUDA buffer, not {buffer.device}")
    reductions = importlib.import_module("torch.multiprocessing.reductions")
    _, args = reductions.reduce_tensor(buffer)
    (_cls, _size, _stride, offset, _scls, _dt, device, handle, ssize, soffset, _rg) = args[:11]
    ref_handle, ref_offset, event, sync = args[11:]
    return IpcHandle(
        device_uuid=device_uuid(int(device)),
        nbytes=int(buffer.numel()),
        handle=_b64(handle),
        storage_size=int(ssize),
        storage_offset=int(soffset),
        tensor_offset=int(offset),
        ref_counter_handle=_b64(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=None if event is None else _b64(event),
        event_sync_required=bool(sync),
    )


def resolve_device(uuid: str, current: int) -> tuple[int | None, str]:
    """Where this process reaches the GPU named ``uuid``, from its device ``current``:
    ``(index, "")`` for its own GPU or a peer it can access, else ``(None, why)``."""
    torch = _torch()
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) != uuid:
            continue
        if i == current or torch.cuda.can_device_access_peer(current, i):
            return i, ""
        return None, f"GPU {uuid} (device {i} here) has no peer access from device {current}"
    return None, f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES)"


def open_buffer(h: IpcHandle, device: int) -> Any:
    """The staging buffer of ``h`` as a flat ``uint8`` tensor on CUDA device ``device`` of
    this process (see :func:`resolve_device`); raises what CUDA raises if it cannot be opened
    (e.g. its owner exited)."""
    torch = _torch()
    reductions = importlib.import_module("torch.multiprocessing.reductions")
    return reductions.rebuild_cuda_tensor(
        torch.Tensor,
        (h.nbytes,),
        (1,),
        h.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        base64.b64decode(h.handle),
        h.storage_size,
        h.storage_offset,
        False,
        base64.b64decode(h.ref_counter_handle),
        h.ref_counter_offset,
        None if h.event_handle is None else base64.b64decode(h.event_handle),
        h.event_sync_required,
    )


def read_tag(buffer: Any) -> int:
    """The tag in ``buffer``'s header (a host sync on the buffer's device)."""
    torch = _torch()
    return int(buffer[:8].view(torch.int64).item())


def write_tag(buffer: Any, tag: int) -> None:
    """Write ``tag`` into ``buffer``'s header, on the current stream (no sync)."""
    torch = _torch()
    buffer[:8].view(torch.int64).fill_(tag)
