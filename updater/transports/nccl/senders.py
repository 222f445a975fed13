"""The trainer side of the NCCL groups: vLLM's trainer helpers, in a thread or a child process.

The transport talks to a :class:`Sender` through typed methods (:meth:`Sender.static_init`,
:meth:`Sender.static_send`, ...). Each builds a :class:`Command` (a small frozen dataclass) and
runs it against a :class:`SenderCore`, the object that holds one vLLM communicator (0.26-0.27) or
trainer engine (0.28+) per group key and calls vLLM's helpers. Where the core lives is the
sender's business:

* :class:`ThreadSender` — in this process; a command runs in the calling thread.
* :class:`ProcessSender` — in a child process (spawned on first use); the command is pickled to
  the child, which runs exactly that command (the child dispatches on the command's type, never
  on a method name) and sends back its result or its error. One command at a time. A sender
  that hangs or dies is killed with its CUDA context, and the updater process never holds a
  stuck collective.

**Blocking.** Every typed method blocks its thread until the command is done (an NCCL
rendezvous, a broadcast, loading a checkpoint onto the GPU): the transport calls them from daemon
threads, never on the event loop. :meth:`Sender.abandon` and :meth:`Sender.close` do not wait
for NCCL.

**Failure.** A failed command raises in the caller (in a child: ``RuntimeError`` naming the
command and the child's error). Abandoning a group tears it down on this side only
(``ncclCommAbort``; a :class:`ProcessSender` kills its child and with it every group it held,
and bumps :attr:`Sender.epoch` so the transport knows they are gone).

``torch`` and ``vllm`` are imported by the first command that needs them, never at module load.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar, cast

from pool.types import TensorSpec
from updater.transports.nccl.config import Packing
from updater.transports.nccl.control import HttpWeightSyncClient
from updater.transports.nccl.sources import SourceSlot, SourceSpec, WeightSource, import_untyped

__all__ = [
    "Command",
    "DirectInit",
    "DirectSend",
    "FactoryInit",
    "FactorySend",
    "Prepare",
    "ProcessSender",
    "Rendezvous",
    "Sender",
    "SenderCore",
    "Shard",
    "StaticInit",
    "StaticSend",
    "ThreadSender",
    "WireSource",
    "shard_key",
]

log = logging.getLogger(__name__)

_NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"

R = TypeVar("R")

#: What a command carries as its weights: the source itself (thread sender) or a recipe the
#: child process rebuilds it from (process sender).
WireSource = WeightSource | SourceSpec


@dataclass(frozen=True)
class Rendezvous:
    """Where one NCCL group meets: the sender (rank 0) hosts it at ``address:port``; ``key``
    names the group on the sending side."""

    key: str
    address: str
    port: int
    world_size: int


# ------------------------------------------------------------------------------ commands


class Command(ABC, Generic[R]):
    """One blocking request to a :class:`SenderCore`; picklable (it may cross into the sending
    child process). :meth:`run` is the whole dispatch: it calls the core method it stands for."""

    @abstractmethod
    def run(self, core: SenderCore) -> R:
        """Do it on ``core`` (in the sender's thread or process)."""


@dataclass(frozen=True)
class Prepare(Command[None]):
    """Load ``source`` onto the GPU and import vLLM's engine module, ahead of a transfer."""

    source: WireSource

    def run(self, core: SenderCore) -> None:
        core.prepare(self.source)


@dataclass(frozen=True)
class StaticInit(Command[float]):
    """0.26-0.27: join the group at ``at`` as rank 0; returns the seconds it took."""

    at: Rendezvous

    def run(self, core: SenderCore) -> float:
        return core.static_init(self.at)


@dataclass(frozen=True)
class StaticSend(Command[dict[str, Any]]):
    """0.26-0.27: broadcast ``source`` over group ``key``; returns the send timings."""

    key: str
    source: WireSource
    packing: Packing
    chunk_timings: bool

    def run(self, core: SenderCore) -> dict[str, Any]:
        return core.static_send(self.key, self.source, self.packing, self.chunk_timings)


@dataclass(frozen=True)
class FactoryInit(Command[float]):
    """0.28+: build vLLM's trainer engine for the group at ``at`` (it calls the replica through
    ``client``); returns the seconds it took."""

    at: Rendezvous
    packing: Packing
    client: HttpWeightSyncClient

    def run(self, core: SenderCore) -> float:
        return core.factory_init(self.at, self.packing, self.client)


@dataclass(frozen=True)
class FactorySend(Command[dict[str, Any]]):
    """0.28+: the engine of group ``key`` sends ``source`` (start, update, finish included)."""

    key: str
    source: WireSource

    def run(self, core: SenderCore) -> dict[str, Any]:
        return core.factory_send(self.key, self.source)


@dataclass(frozen=True)
class DirectInit(Command[float]):
    """``nccl_direct``: join the group at ``at`` as rank 0 with vLLM's communicator (no
    weight-transfer engine); returns the seconds it took."""

    at: Rendezvous

    def run(self, core: SenderCore) -> float:
        return core.direct_init(self.at)


#: A slice of one tensor a tensor-parallel rank holds: ``(name, dim, start, length)``.
Shard = tuple[str, int, int, int]


def shard_key(shard: Shard) -> str:
    """The name the sender's checksum of ``shard`` is returned under."""
    name, dim, start, length = shard
    return f"{name}|{dim}:{start}:{length}"


@dataclass(frozen=True)
class DirectSend(Command[dict[str, Any]]):
    """``nccl_direct``: broadcast the tensors of ``source`` named in ``wire`` (in order) over
    group ``key``, one broadcast each, and checksum *every* tensor of the source meanwhile, and
    each slice in ``shards`` (what tensor-parallel ranks hold); returns the timings,
    ``checksums`` and ``shard_checksums`` (by :func:`shard_key`; :func:`pool.checksum.to_json`)."""

    key: str
    source: WireSource
    wire: tuple[str, ...]
    shards: tuple[Shard, ...] = ()

    def run(self, core: SenderCore) -> dict[str, Any]:
        return core.direct_send(self.key, self.source, self.wire, self.shards)


# ------------------------------------------------------------------------------ senders


class Sender(ABC):
    """Where the :class:`SenderCore` runs. The typed methods block (see the module docstring);
    subclasses implement :meth:`run`, :meth:`abandon` and :meth:`close`."""

    #: Changes whenever the groups held so far are gone (a replaced sending process).
    epoch: int = 0

    @abstractmethod
    def run(self, command: Command[R]) -> R:
        """Run ``command`` on the core; blocks until it is done; raises what it raised."""

    @abstractmethod
    def abandon(self, key: str) -> None:
        """Tear down group ``key`` on this side (unblocks a stuck broadcast). Does not wait."""

    @abstractmethod
    def close(self) -> None:
        """Abandon every group; the sender may be used again (it starts afresh)."""

    def prepare(self, source: WireSource) -> None:
        self.run(Prepare(source))

    def static_init(self, at: Rendezvous) -> float:
        return self.run(StaticInit(at))

    def static_send(
        self, key: str, source: WireSource, packing: Packing, chunk_timings: bool
    ) -> dict[str, Any]:
        return self.run(StaticSend(key, source, packing, chunk_timings))

    def factory_init(self, at: Rendezvous, packing: Packing, client: HttpWeightSyncClient) -> float:
        return self.run(FactoryInit(at, packing, client))

    def factory_send(self, key: str, source: WireSource) -> dict[str, Any]:
        return self.run(FactorySend(key, source))

    def direct_init(self, at: Rendezvous) -> float:
        return self.run(DirectInit(at))

    def direct_send(
        self, key: str, source: WireSource, wire: tuple[str, ...], shards: tuple[Shard, ...] = ()
    ) -> dict[str, Any]:
        return self.run(DirectSend(key, source, wire, shards))


class ThreadSender(Sender):
    """The core in this process; a command runs in the caller's (daemon) thread."""

    def __init__(self, device: str, core: SenderCore | None = None) -> None:
        self.core = core or SenderCore(device)

    def run(self, command: Command[R]) -> R:
        return command.run(self.core)

    def abandon(self, key: str) -> None:
        # ncclCommAbort may itself block a while: never on the event loop
        threading.Thread(
            target=self.core.abort, args=(key,), daemon=True, name=f"nccl-abort-{key}"
        ).start()

    def close(self) -> None:
        for key in list(self.core.groups):
            self.abandon(key)


class ProcessSender(Sender):
    """The core in a child process (spawned on first use): sources must be :class:`SourceSpec`
    recipes. Abandoning any group kills the child (and with it every group it held, so they are
    re-created on next use); a stuck collective dies with its CUDA context."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.epoch = 0  # bumped each time the child is replaced

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _ensure(self) -> tuple[Connection, BaseProcess]:
        if self._proc is not None and self._conn is not None and self._proc.is_alive():
            return self._conn, self._proc
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_main,
            args=(child, self.device),
            daemon=True,
            name="rolloutpool-nccl-sender",
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        self.epoch += 1
        return parent, proc

    def run(self, command: Command[R]) -> R:
        what = type(command).__name__
        with self._lock:  # one command at a time; a killed child releases a stuck caller
            conn, proc = self._ensure()
            conn.send(command)
            while True:
                if conn.poll(0.05):
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError) as e:
                        raise RuntimeError(f"sender process died during {what}") from e
                    if status == "err":
                        raise RuntimeError(f"sender process: {what}: {value}")
                    return cast(R, value)
                if not proc.is_alive():
                    raise RuntimeError(f"sender process died during {what} (exit {proc.exitcode})")

    def abandon(self, key: str) -> None:
        self.kill()

    def kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
        self._proc = None

    def close(self) -> None:
        self.kill()


def _child_main(conn: Connection, device: str) -> None:  # pragma: no cover - in the child
    """The sending child's loop: one :class:`Command` in, ``("ok", result)`` or
    ``("err", text)`` out. Anything that is not a command is answered with an error."""
    core = SenderCore(device)
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            command = pickle.loads(raw)
            if not isinstance(command, Command):
                raise TypeError(f"not a sender command: {type(command).__name__}")
            conn.send(("ok", command.run(core)))
        except BaseException as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


# ------------------------------------------------------------------------------ the core


class SenderCore:
    """The trainer side of the groups, in whichever process sends: holds one vLLM communicator
    (0.26-0.27) or trainer engine (0.28+) per key and calls vLLM's helpers. Methods block; they
    run in sender threads (or the sending child process), one command per group at a time."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.groups: dict[str, Any] = {}
        self._sources: SourceSlot[SourceSpec] = SourceSlot()

    def _set_device(self) -> None:
        torch = import_untyped("torch")
        torch.cuda.set_device(torch.device(self.device))

    def source(self, spec: SourceSpec) -> WeightSource:
        """The source ``spec`` builds, built once; building another releases the previous one
        (one checkpoint on the GPU at a time)."""
        return self._sources.get(spec, spec.build)

    def _resolve(self, source: WireSource) -> WeightSource:
        src = self.source(source) if isinstance(source, SourceSpec) else source
        src.prepare()
        return src

    def prepare(self, source: WireSource) -> None:
        """Load the source and import vLLM's engine module now (a fresh sending process spends
        seconds on both), so neither lands inside the paused window or the transfer deadline."""
        self._set_device()
        self._resolve(source)
        import_untyped(_NCCL_ENGINE)

    # -- 0.26-0.27 ---------------------------------------------------------------------------

    def static_init(self, at: Rendezvous) -> float:
        engine_cls = import_untyped(_NCCL_ENGINE).NCCLWeightTransferEngine
        self._set_device()
        t0 = time.perf_counter()
        self.groups[at.key] = engine_cls.trainer_init(
            {"master_address": at.address, "master_port": at.port, "world_size": at.world_size}
        )
        return time.perf_counter() - t0

    def static_send(
        self, key: str, source: WireSource, packing: Packing, chunk_timings: bool
    ) -> dict[str, Any]:
        torch = import_untyped("torch")
        nccl_engine = import_untyped(_NCCL_ENGINE)
        self._set_device()
        src = self._resolve(source)
        group = self.groups[key]
        timed = _TimedGroup(group) if chunk_timings else None
        args = nccl_engine.NCCLTrainerSendWeightsArgs(
            group=timed or group,
            src=0,
            packed=packing.packed,
            packed_buffer_size_bytes=packing.buffer_bytes,
            packed_num_buffers=packing.num_buffers,
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nccl_engine.NCCLWeightTransferEngine.trainer_send_weights(iter(src), args)
        enqueued = time.perf_counter() - t0
        torch.cuda.synchronize()
        out: dict[str, Any] = {"send_enqueue_s": enqueued, "send_s": time.perf_counter() - t0}
        if timed is not None:
            out["chunks"] = timed.report()
        return out

    # -- 0.28+ -------------------------------------------------------------------------------

    def factory_init(self, at: Rendezvous, packing: Packing, client: HttpWeightSyncClient) -> float:
        factory = import_untyped(
            "vllm.distributed.weight_transfer.factory"
        ).WeightTransferTrainerFactory
        self._set_device()
        info = import_untyped(_NCCL_ENGINE).NCCLTrainerInitInfo(
            master_address=at.address,
            master_port=at.port,
            world_size=at.world_size,
            packed=packing.packed,
            packed_buffer_size_bytes=packing.buffer_bytes,
            packed_num_buffers=packing.num_buffers,
            rank=0,
        )
        t0 = time.perf_counter()
        self.groups[at.key] = factory.trainer_init(
            info, client=client, source=_vllm_source(_NoTensors())
        )
        return time.perf_counter() - t0

    def factory_send(self, key: str, source: WireSource) -> dict[str, Any]:
        torch = import_untyped("torch")
        self._set_device()
        src = self._resolve(source)
        engine = self.groups[key]
        engine.source = _vllm_source(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.send_weights()  # start, update (its own thread) + broadcast, finish, sync
        return {"send_s": time.perf_counter() - t0}

    # -- nccl_direct ----------------------------------------------------------------------------

    def direct_init(self, at: Rendezvous) -> float:
        """Rank 0 of a plain vLLM NCCL group (``StatelessProcessGroup`` + ``PyNcclCommunicator``,
        present in every vLLM with a weight-transfer engine); the replica's worker extension
        joins it as rank 1."""
        torch = import_untyped("torch")
        pynccl = import_untyped("vllm.distributed.device_communicators.pynccl")
        utils = import_untyped("vllm.distributed.utils")
        self._set_device()
        t0 = time.perf_counter()
        pg = utils.StatelessProcessGroup.create(
            host=at.address, port=at.port, rank=0, world_size=at.world_size
        )
        device = torch.device("cuda", torch.cuda.current_device())
        self.groups[at.key] = pynccl.PyNcclCommunicator(pg, device=device)
        return time.perf_counter() - t0

    def direct_send(
        self, key: str, source: WireSource, wire: tuple[str, ...], shards: tuple[Shard, ...] = ()
    ) -> dict[str, Any]:
        """One broadcast per tensor named in ``wire`` (in that order, on a stream of its own),
        straight from the source's tensors; meanwhile the checksums of every tensor of the
        source, and of each slice in ``shards``, are computed on a second stream (both only
        read the tensors, so they overlap on the GPU). Returns when both are done."""
        torch = import_untyped("torch")
        checksum = import_untyped("pool.checksum")
        self._set_device()
        src = self._resolve(source)
        group = self.groups[key]
        named = list(src)
        by_name = dict(named)
        missing = [n for n in wire if n not in by_name]
        if missing:
            raise RuntimeError(f"the source has no tensor {missing[0]!r}")
        send_stream, sum_stream = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for name in wire:
            group.broadcast(by_name[name], src=0, stream=send_stream)
        enqueued = time.perf_counter() - t0
        slices = [(shard_key(s), by_name[s[0]].narrow(*s[1:])) for s in shards if s[0] in by_name]
        sums = checksum.tensor_checksums(named + slices, stream=sum_stream)  # syncs sum_stream
        checksum_s = time.perf_counter() - t0 - enqueued
        send_stream.synchronize()
        keys = {k for k, _ in slices}
        return {
            "send_enqueue_s": enqueued,
            "send_s": time.perf_counter() - t0,
            "checksum_s": checksum_s,
            "checksums": checksum.to_json({k: v for k, v in sums.items() if k not in keys}),
            "shard_checksums": checksum.to_json({k: v for k, v in sums.items() if k in keys}),
        }

    # -- teardown ----------------------------------------------------------------------------

    def abort(self, key: str) -> None:
        """Abandon a group: ``ncclCommAbort`` on the trainer side (unblocks stuck kernels)."""
        group = self.groups.pop(key, None)
        comm = getattr(group, "model_update_group", group)  # 0.28+ engine holds it
        destroy = getattr(comm, "destroy", None)
        if destroy is not None:
            try:
                destroy()
            except Exception as e:  # best effort: the group is gone from here either way
                log.warning("aborting NCCL group %s: %r", key, e)


# ------------------------------------------------------------------------------ vLLM adapters


class _TimedGroup:
    """Wraps a PyNcclCommunicator: CUDA events around each broadcast (for the breakdown)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.records: list[tuple[int, float, Any, Any]] = []

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        torch = import_untyped("torch")
        s = stream or torch.cuda.current_stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        self.group.broadcast(tensor, src=src, stream=stream)
        e1.record(s)
        self.records.append((tensor.numel() * tensor.element_size(), time.perf_counter(), e0, e1))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def report(self) -> list[dict[str, float]]:
        if not self.records:
            return []
        first = self.records[0][2]
        out = []
        for nbytes, _t, e0, e1 in self.records:
            out.append(
                {
                    "bytes": nbytes,
                    "start_ms": first.elapsed_time(e0),
                    "end_ms": first.elapsed_time(e1),
                    "kernel_ms": e0.elapsed_time(e1),
                }
            )
        return out


def _vllm_source(src: WeightSource) -> Any:
    """Adapt a :class:`WeightSource` to vLLM's (0.28+) ``WeightSource`` ABC."""
    torch = import_untyped("torch")
    base = import_untyped("vllm.distributed.weight_transfer.base")

    vllm_weight_source: Any = base.WeightSource

    class _Adapter(vllm_weight_source):  # type: ignore[misc]
        def metadata(self) -> list[Any]:
            return [
                base.ParamMeta(s.name, getattr(torch, s.dtype), tuple(s.shape)) for s in src.specs()
            ]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(src)

    return _Adapter()


class _NoTensors(WeightSource):
    """The empty source a 0.28+ trainer engine is built with (the real one is set per send)."""

    def specs(self) -> list[TensorSpec]:
        return []

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(())
