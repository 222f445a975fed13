"""The trainer side of the NCCL groups: vLLM's trainer helpers, in a thread or a child process.

:class:`SenderCore` holds one vLLM communicator (0.26-0.27) or trainer engine (0.28+) per group
key and calls vLLM's helpers; its methods block (NCCL rendezvous, broadcasts, loading a
checkpoint onto the GPU). Where it runs is the :class:`Sender`:

* :class:`ThreadSender` — in this process; each call runs in the calling (daemon) thread.
* :class:`ProcessSender` — in a child process (spawned on first use, one call at a time); a
  sender that hangs or dies is killed with its CUDA context, and the updater process never
  holds a stuck collective.

``torch`` and ``vllm`` are imported on the first call that needs them, never at module load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from pool.types import TensorSpec
from updater.transports.nccl.config import Packing
from updater.transports.nccl.control import HttpWeightSyncClient
from updater.transports.nccl.sources import SourceSpec, WeightSource, import_untyped

__all__ = ["ProcessSender", "Sender", "SenderCore", "ThreadSender"]

log = logging.getLogger(__name__)

_NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"


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


class SenderCore:
    """The trainer side of the groups, in whichever process sends: holds one vLLM communicator
    (0.26-0.27) or trainer engine (0.28+) per key and calls vLLM's helpers. Methods block and
    are called from sender threads (or a sending child process)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.groups: dict[str, Any] = {}
        self.sources: dict[SourceSpec, WeightSource] = {}

    def _set_device(self) -> None:
        torch = import_untyped("torch")
        torch.cuda.set_device(torch.device(self.device))

    def source(self, spec: SourceSpec) -> WeightSource:
        src = self.sources.get(spec)
        if src is None:
            for old in self.sources.values():  # one checkpoint on the GPU at a time
                old.release()
            self.sources.clear()
            src = self.sources[spec] = spec.build()
        return src

    def prepare(self, source: WeightSource | SourceSpec) -> None:
        """Load the source and import vLLM's engine module now (a fresh sending process spends
        seconds on both), so neither lands inside the paused window or the transfer deadline."""
        self._set_device()
        src = self.source(source) if isinstance(source, SourceSpec) else source
        src.prepare()
        import_untyped(_NCCL_ENGINE)

    # -- 0.26-0.27 ---------------------------------------------------------------------------

    def static_init(self, key: str, address: str, port: int, world_size: int) -> float:
        engine_cls = import_untyped(_NCCL_ENGINE).NCCLWeightTransferEngine
        self._set_device()
        t0 = time.perf_counter()
        self.groups[key] = engine_cls.trainer_init(
            {"master_address": address, "master_port": port, "world_size": world_size}
        )
        return time.perf_counter() - t0

    def static_send(
        self, key: str, source: WeightSource | SourceSpec, packing: Packing, chunk_timings: bool
    ) -> dict[str, Any]:
        torch = import_untyped("torch")
        nccl_engine = import_untyped(_NCCL_ENGINE)
        self._set_device()
        src = self.source(source) if isinstance(source, SourceSpec) else source
        src.prepare()
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

    def factory_init(
        self,
        key: str,
        address: str,
        port: int,
        world_size: int,
        packing: Packing,
        client: HttpWeightSyncClient,
    ) -> float:
        factory = import_untyped(
            "vllm.distributed.weight_transfer.factory"
        ).WeightTransferTrainerFactory
        self._set_device()
        info = import_untyped(_NCCL_ENGINE).NCCLTrainerInitInfo(
            master_address=address,
            master_port=port,
            world_size=world_size,
            packed=packing.packed,
            packed_buffer_size_bytes=packing.buffer_bytes,
            packed_num_buffers=packing.num_buffers,
            rank=0,
        )
        t0 = time.perf_counter()
        self.groups[key] = factory.trainer_init(info, client=client, source=_EmptyVllmSource.make())
        return time.perf_counter() - t0

    def factory_send(self, key: str, source: WeightSource | SourceSpec) -> dict[str, Any]:
        torch = import_untyped("torch")
        self._set_device()
        src = self.source(source) if isinstance(source, SourceSpec) else source
        src.prepare()
        engine = self.groups[key]
        engine.source = _vllm_source(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.send_weights()  # start, update (its own thread) + broadcast, finish, sync
        return {"send_s": time.perf_counter() - t0}

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


class _EmptyVllmSource:
    @staticmethod
    def make() -> Any:
        return _vllm_source(_NoTensors())


class _NoTensors(WeightSource):
    def specs(self) -> list[TensorSpec]:
        return []

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(())


class Sender(Protocol):
    """Where :class:`SenderCore` runs: this process (threads) or a child process."""

    def call(self, op: str, *args: Any) -> Any: ...
    def abandon(self, key: str) -> None: ...
    def close(self) -> None: ...


class ThreadSender:
    """The core in this process; ``call`` runs in the caller's (daemon) thread."""

    def __init__(self, device: str, core: SenderCore | None = None) -> None:
        self.core = core or SenderCore(device)

    def call(self, op: str, *args: Any) -> Any:
        return getattr(self.core, op)(*args)

    def abandon(self, key: str) -> None:
        # ncclCommAbort may itself block a while: never on the event loop
        threading.Thread(
            target=self.core.abort, args=(key,), daemon=True, name=f"nccl-abort-{key}"
        ).start()

    def close(self) -> None:
        for key in list(self.core.groups):
            self.abandon(key)


def _child_main(conn: Any, device: str) -> None:  # pragma: no cover - runs in a child process
    core = SenderCore(device)
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", getattr(core, op)(*args)))
        except BaseException as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


class ProcessSender:
    """The core in a child process (spawned on first use): sources must be :class:`SourceSpec`
    recipes. Abandoning any group kills the child (and with it every group it held, so they are
    re-created on next use); a stuck collective dies with its CUDA context."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self.epoch = 0  # bumped each time the child is replaced

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
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

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:  # one command at a time; a killed child releases a stuck caller
            self._ensure()
            conn, proc = self._conn, self._proc
            conn.send((op, args))
            while True:
                if conn.poll(0.05):
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError) as e:
                        raise RuntimeError(f"sender process died during {op}") from e
                    if status == "err":
                        raise RuntimeError(f"sender process: {op}: {value}")
                    return value
                if not proc.is_alive():
                    raise RuntimeError(f"sender process died during {op} (exit {proc.exitcode})")

    def abandon(self, key: str) -> None:
        self.kill()

    def kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
        self._proc = None

    def close(self) -> None:
        self.kill()
