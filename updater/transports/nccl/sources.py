"""What the NCCL transport sends: a :class:`WeightSource` yields ``(name, tensor)`` on the
sender's GPU in a fixed order, and declares that order without data (:meth:`WeightSource.specs`).

* :class:`ModuleSource` — in process: a trainer's ``torch.nn.Module`` (or a callable returning
  named tensors), sent as it is.
* :class:`CheckpointSource` — service mode: a safetensors checkpoint directory, loaded onto the
  sender's GPU.
* :class:`StagedSource` — staging mode: one copy of a trainer's weights on its GPU, owned by the
  updater; the trainer hands its weights over with :meth:`StagedSource.stage` and goes on
  training while every replica is rolled from the copy.
* :class:`SourceSpec` — a picklable recipe that rebuilds a source in another process (the
  sending child of ``sender="process"``).
* :class:`SourceSlot` — holds one built source at a time (one checkpoint on the GPU).

Where things run: :meth:`~WeightSource.specs` is cheap and runs wherever the transport checks the
target (a worker thread of the updater); :meth:`~WeightSource.prepare` and iteration block (disk
reads, host-to-GPU copies) and run in the sender's thread or process, never on the event loop. A
failed ``prepare`` leaves nothing loaded. ``torch`` and ``safetensors.torch`` are imported on the
first ``prepare``, never at module load.
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pool.checkpoint import read_header, read_manifest, safetensors_files
from pool.types import DTYPE_BYTES, Manifest, TensorSpec

__all__ = [
    "CheckpointSource",
    "ModuleSource",
    "SourceSlot",
    "SourceSpec",
    "StagedSource",
    "WeightSource",
    "import_untyped",
    "nbytes_of",
]


def import_untyped(name: str) -> Any:
    """Import ``name`` lazily, untyped: torch / vLLM / safetensors.torch differ by version and
    are absent on CPU-only machines, so nothing here is typed against one of them."""
    return importlib.import_module(name)


@dataclass(frozen=True)
class SourceSpec:
    """A picklable recipe for a :class:`WeightSource`: ``factory`` is ``"module:qualname"``,
    called with ``kwargs``. Lets a sending child process build the same source."""

    factory: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self) -> WeightSource:
        module, _, qual = self.factory.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        src = obj(**dict(self.kwargs))
        if not isinstance(src, WeightSource):
            raise TypeError(f"{self.factory} built {type(src).__name__}, not a WeightSource")
        return src


class WeightSource(ABC):
    """The weights to send, on the sender's GPU: ``specs()`` in send order (cheap, no data),
    then iteration yields ``(name, tensor)`` in exactly that order."""

    @abstractmethod
    def specs(self) -> list[TensorSpec]:
        """Names, shapes and dtypes, in the order :meth:`__iter__` yields them."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor)`` (CUDA tensors, no autograd history)."""

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Load whatever iteration needs (e.g. a checkpoint onto the GPU). Idempotent."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Drop what :meth:`prepare` loaded (the next ``prepare`` loads it again)."""

    def spec(self) -> SourceSpec | None:
        """A recipe to rebuild this source in another process, or None if it cannot be."""
        return None

    def manifest(self) -> Manifest:
        return Manifest.of(self.specs())

    def nbytes(self) -> int:
        return nbytes_of(self.specs())


def nbytes_of(specs: Iterable[TensorSpec]) -> int:
    """Bytes on the wire for ``specs`` (a dtype not in the table counts 0)."""
    return sum(math.prod(s.shape) * DTYPE_BYTES.get(s.dtype, 0) for s in specs)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


NamedParams = Callable[[], Iterable[tuple[str, Any]]]


class ModuleSource(WeightSource):
    """In-process source: a ``torch.nn.Module`` (its ``named_parameters()``) or a callable that
    returns such ``(name, tensor)`` pairs each time it is called. Tensors are sent as they are
    (detached); the caller must not step the optimizer while a transfer runs."""

    def __init__(self, model: Any) -> None:
        if callable(getattr(model, "named_parameters", None)):
            self._named: NamedParams = model.named_parameters
        elif callable(model):
            self._named = model
        else:
            raise TypeError("ModuleSource needs a module or a callable returning named tensors")

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name=n, shape=tuple(int(d) for d in p.shape), dtype=_dtype_name(p.dtype))
            for n, p in self._named()
        ]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, p in self._named():
            yield name, p.detach()


class CheckpointSource(WeightSource):
    """Service-mode source: a safetensors checkpoint directory, loaded onto ``device`` by
    :meth:`prepare` and sent in file order (each file's tensors by offset: the writer's order,
    which for a Hugging Face save is ``named_parameters()`` order and keeps vLLM's layerwise
    reload from buffering more than one layer). ``specs()`` reads headers only (no torch) and
    is cached: a checkpoint directory is not expected to change under its path."""

    def __init__(self, path: str | Path, device: str = "cuda:0") -> None:
        self.path = Path(path)
        self.device = device
        self._tensors: dict[str, Any] | None = None
        self._specs: list[TensorSpec] | None = None

    def specs(self) -> list[TensorSpec]:
        if self._specs is None:
            manifest = read_manifest(self.path).by_name()  # validates every header
            order: list[str] = []
            for file in safetensors_files(self.path):
                header = read_header(file)
                names = [n for n in header if n != "__metadata__"]
                names.sort(key=lambda n: header[n].get("data_offsets", [0])[0])
                order += names
            self._specs = [manifest[n] for n in order]
        return list(self._specs)

    def prepare(self) -> None:
        if self._tensors is not None:
            return
        load_file = import_untyped("safetensors.torch").load_file  # torch needed from here on
        tensors: dict[str, Any] = {}
        for file in safetensors_files(self.path):
            tensors.update(load_file(str(file), device=self.device))
        self._tensors = tensors

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.prepare()
        assert self._tensors is not None
        for s in self.specs():
            yield s.name, self._tensors[s.name]

    def spec(self) -> SourceSpec | None:
        return SourceSpec(
            f"{type(self).__module__}:{type(self).__qualname__}",
            (("path", str(self.path)), ("device", self.device)),
        )

    def release(self) -> None:
        self._tensors = None


class StagedSource(WeightSource):
    """Staging mode (the trainer never waits for the roll): one copy of the trainer's weights on
    the same GPU, in buffers this source owns (allocated by the first :meth:`stage`, reused
    while names, shapes and dtypes stay the same).

    :meth:`stage` copies the trainer's tensors device-to-device (one fused copy) and returns
    once the copy is complete: from then on the trainer may change its weights; its stall is
    that copy, whatever the number of replicas. The updater then sends every replica from the
    copy (:class:`~updater.transports.nccl.NcclTransport` or ``nccl_direct`` with this as the
    ``source``). Across hosts the copy would instead be one NCCL transfer to the updater's GPU
    (not built here). ``stage`` must not run while a transfer reads the previous copy: stage
    the next generation after the previous roll finished (one buffer; a second would lift
    this). Blocking; used from one thread at a time.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[str, Any]] = []
        self._specs: list[TensorSpec] = []

    def stage(self, named: Any) -> float:
        """Copy ``named`` (``(name, tensor)`` pairs, or a module: its ``named_parameters()``)
        into the staging buffers; returns the seconds the trainer waited (copy + sync)."""
        torch = import_untyped("torch")
        if callable(getattr(named, "named_parameters", None)):
            named = named.named_parameters()
        pairs = [(n, t.detach()) for n, t in named]
        specs = [
            TensorSpec(name=n, shape=tuple(int(d) for d in t.shape), dtype=_dtype_name(t.dtype))
            for n, t in pairs
        ]
        t0 = time.perf_counter()
        if specs != self._specs or any(
            b.device != t.device for (_, b), (_, t) in zip(self._staged, pairs, strict=True)
        ):
            self._staged = [
                (n, torch.empty_like(t, memory_format=torch.contiguous_format)) for n, t in pairs
            ]
            self._specs = specs
        dsts = [b for _, b in self._staged]
        torch._foreach_copy_(dsts, [t for _, t in pairs])
        if any(b.is_cuda for b in dsts):
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self._staged))

    def release(self) -> None:
        self._staged, self._specs = [], []


K = TypeVar("K", bound=Hashable)


class SourceSlot(Generic[K]):
    """At most one built source at a time, so at most one checkpoint sits on the sender's GPU:
    asking for another key releases the source held before building the new one. Used from one
    thread at a time."""

    def __init__(self) -> None:
        self._key: K | None = None
        self._source: WeightSource | None = None

    def get(self, key: K, build: Callable[[], WeightSource]) -> WeightSource:
        """The source held for ``key``, built by ``build`` unless it is the one held. If
        ``build`` raises, the slot is left empty (the previous source already released)."""
        if self._source is None or self._key != key:
            old, self._source = self._source, None
            if old is not None:
                old.release()
            self._source, self._key = build(), key
        return self._source
