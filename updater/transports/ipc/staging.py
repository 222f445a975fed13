"""The sending side of ``ipc_direct``: staged copies of a trainer's weights on its GPU.

:class:`IpcStaging` owns ``slots`` flat ``uint8`` buffers on the trainer's GPU. :meth:`stage`
copies the trainer's tensors into the next slot (round robin; one fused device-to-device copy)
under the layout of :mod:`pool.ipc_handles` (a header with the copy's *tag*, then every tensor
at an aligned offset, in the order given: a module's ``named_parameters()`` order keeps vLLM's
fused q/k/v and gate/up blocks consecutive, so a replica copies one runtime parameter at a
time) and returns once the copy is complete: the trainer's stall is that copy. A slot is
allocated by the first copy that needs it and reused while the tensors' names, shapes and
dtypes stay the same.

**Which copy is where.** Each :class:`StagedCopy` has a unique tag, written into its slot's
header after the data (0 while the slot is rewritten); a replica checks it before and after
copying (:mod:`pool.replica_extension`). With ``slots`` = k, the k newest copies stay intact:
a trainer that stages a generation only after the previous update ended (at most one in
flight, as :class:`rolloutpool.integrations.trl.PoolLink` does) with k = 2 always keeps the
latest *published* generation's copy while the next one rolls, so a replica recovered meanwhile
can load it from memory.

**Checksums** of a copy (:meth:`checksums`, :mod:`pool.checksum` on the GPU) are computed on
first use and kept with it, as are those of slices a tensor-parallel rank holds.

:meth:`descriptor` is what another process needs to load a copy (the slot's CUDA IPC handle,
the entries, the tag, the checksums): :class:`IpcDescriptor`, JSON. Blocking; one thread at a
time. ``torch`` is imported on first use.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pool.checksum import Checksum, tensor_checksums, to_json
from pool.ipc_handles import Entry, IpcHandle, export_buffer, layout, write_tag
from pool.types import Manifest, TensorSpec
from updater.transports.nccl.senders import Shard, shard_key
from updater.transports.nccl.sources import import_untyped

__all__ = ["SIDECAR", "IpcDescriptor", "IpcStaging", "StagedCopy"]

#: The file in a checkpoint directory that names the staged copy it was written from.
SIDECAR = "rolloutpool-ipc.json"

_seq = itertools.count(1)


def _new_tag() -> int:
    """A positive int63, unique to this copy with overwhelming probability (across processes
    too: a replica must never take another trainer's copy for the one it was sent)."""
    return secrets.randbits(62) | 1


def _dtype(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class StagedCopy:
    """One staged copy: where (``slot``), which (``tag``), what (``entries``), and what it cost
    the trainer (``stall_s``: copy + sync)."""

    slot: int
    tag: int
    seq: int  # staging order in this process
    key: str
    entries: tuple[Entry, ...]
    nbytes: int
    stall_s: float

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name=e.name, shape=e.shape, dtype=e.dtype) for e in self.entries]

    def manifest(self) -> Manifest:
        return Manifest.of(self.specs())


class IpcDescriptor(BaseModel):
    """A staged copy as another process loads it (a replica, the updater reading a
    checkpoint's :data:`SIDECAR`): the slot's handle, the entries, the tag, the sender's
    checksums (:func:`pool.checksum.to_json`), the manifest digest, the owner's pid."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    handle: dict[str, Any]
    entries: list[list[Any]] = Field(min_length=1)
    tag: int = Field(gt=0)
    manifest_digest: str
    checksums: dict[str, list[Any]]
    pid: int
    key: str = ""

    def ipc_handle(self) -> IpcHandle:
        return IpcHandle.from_json(self.handle)

    def parsed_entries(self) -> list[Entry]:
        return [Entry.from_json(e) for e in self.entries]


@dataclass
class _Slot:
    buffer: Any = None
    specs: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)
    entries: tuple[Entry, ...] = ()
    handle: IpcHandle | None = None
    copy: StagedCopy | None = None
    sums: dict[str, Checksum] | None = None
    shard_sums: dict[str, Checksum] = field(default_factory=dict)


class IpcStaging:
    """Staged copies of a trainer's weights (see the module docstring). ``slots`` >= 1."""

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0

    # -- staging -----------------------------------------------------------------------------

    def stage(self, named: Any, key: str = "") -> StagedCopy:
        """Copy ``named`` (``(name, tensor)`` pairs on one device, or a module: its
        ``named_parameters()``) into the next slot and wait for the copy; ``key`` names the
        copy for :meth:`find` (e.g. the generation's identity digest)."""
        torch = import_untyped("torch")
        if callable(getattr(named, "named_parameters", None)):
            named = named.named_parameters()
        pairs = [(n, t.detach()) for n, t in named]
        if not pairs:
            raise ValueError("nothing to stage")
        device = pairs[0][1].device
        specs = [(n, _dtype(t), tuple(int(d) for d in t.shape)) for n, t in pairs]
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        t0 = time.perf_counter()
        if slot.specs != specs or slot.buffer is None or slot.buffer.device != device:
            entries, total = layout(specs)
            slot.buffer = None  # free the old allocation first
            slot.buffer = torch.zeros(total, dtype=torch.uint8, device=device)
            slot.specs, slot.entries, slot.handle = specs, tuple(entries), None
        slot.copy, slot.sums, slot.shard_sums = None, None, {}
        write_tag(slot.buffer, 0)
        dsts = [e.view(slot.buffer) for e in slot.entries]
        torch._foreach_copy_(dsts, [t for _, t in pairs])
        tag = _new_tag()
        write_tag(slot.buffer, tag)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        nbytes = sum(e.nbytes for e in slot.entries)
        stall = time.perf_counter() - t0
        slot.copy = StagedCopy(i, tag, next(_seq), key, slot.entries, nbytes, stall)
        return slot.copy

    # -- lookups ---------------------------------------------------------------------------------

    def find(self, key: str) -> StagedCopy | None:
        """The newest intact copy staged under ``key``, if any."""
        found = [s.copy for s in self._slots if s.copy is not None and s.copy.key == key]
        return max(found, key=lambda c: c.seq, default=None)

    def holds(self, copy: StagedCopy) -> bool:
        """Whether ``copy``'s slot still holds it (not restaged since)."""
        return self._slots[copy.slot].copy == copy

    def _slot(self, copy: StagedCopy) -> _Slot:
        slot = self._slots[copy.slot]
        if slot.copy != copy:
            raise LookupError(f"slot {copy.slot} no longer holds copy {copy.tag}")
        return slot

    def buffer(self, copy: StagedCopy) -> Any:
        """The flat ``uint8`` buffer holding ``copy`` (``LookupError`` once restaged)."""
        return self._slot(copy).buffer

    def views(self, copy: StagedCopy) -> list[tuple[str, Any]]:
        """``copy``'s tensors, as typed views of its slot (no copy)."""
        buf = self.buffer(copy)
        return [(e.name, e.view(buf)) for e in copy.entries]

    # -- checksums -------------------------------------------------------------------------------

    def checksums(self, copy: StagedCopy) -> dict[str, Checksum]:
        """Checksums of every tensor of ``copy`` (computed once, then kept with it)."""
        slot = self._slot(copy)
        if slot.sums is None:
            slot.sums = tensor_checksums(self.views(copy))
        return slot.sums

    def shard_checksums(self, copy: StagedCopy, shards: tuple[Shard, ...]) -> dict[str, Checksum]:
        """Checksums of the slices ``shards`` of ``copy``'s tensors, by
        :func:`~updater.transports.nccl.senders.shard_key` (computed once each)."""
        slot = self._slot(copy)
        by_name = dict(self.views(copy))
        todo = [s for s in shards if shard_key(s) not in slot.shard_sums and s[0] in by_name]
        if todo:
            slot.shard_sums.update(
                tensor_checksums([(shard_key(s), by_name[s[0]].narrow(*s[1:])) for s in todo])
            )
        return {shard_key(s): slot.shard_sums[shard_key(s)] for s in shards if s[0] in by_name}

    # -- another process -------------------------------------------------------------------------

    def handle(self, copy: StagedCopy) -> IpcHandle:
        """The CUDA IPC handle of ``copy``'s slot (exported once per allocation)."""
        slot = self._slot(copy)
        if slot.handle is None:
            slot.handle = export_buffer(slot.buffer)
        return slot.handle

    def descriptor(self, copy: StagedCopy) -> IpcDescriptor:
        """What another process needs to load ``copy`` (its checksums computed here)."""
        return IpcDescriptor(
            handle=self.handle(copy).to_json(),
            entries=[e.to_json() for e in copy.entries],
            tag=copy.tag,
            manifest_digest=copy.manifest().digest,
            checksums=to_json(self.checksums(copy)),
            pid=os.getpid(),
            key=copy.key,
        )

    def release(self) -> None:
        """Free every slot (a replica that opened one keeps its mapping until it closes it)."""
        self._slots = [_Slot() for _ in self._slots]
        self._next = 0
