"""Settings of the NCCL transport: the rendezvous ports, packing, timeouts, the sending GPU.

Pure data (pydantic, frozen): nothing here does I/O or imports ``torch`` / ``vllm``. The ports
are explained in :mod:`updater.transports.nccl` ("Multi-node").
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["GIB", "NcclConfig", "Packing"]

GIB = 1024 * 1024 * 1024


class Packing(BaseModel):
    """vLLM's packed broadcast: tensors are concatenated into ``buffer_bytes`` chunks and up to
    ``num_buffers`` chunks are in flight. ``packed=False`` broadcasts tensor by tensor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    packed: bool = True
    buffer_bytes: int = Field(default=GIB, gt=0)
    num_buffers: int = Field(default=2, ge=1, le=64)


class NcclConfig(BaseModel):
    """Settings of :class:`~updater.transports.nccl.NcclTransport`."""

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
    #: Service mode: verify a declared ``identity.content_hash`` in preflight (one full read of
    #: the checkpoint per replica; off by default for multi-GB checkpoints).
    verify_content_hash: bool = False
    chunk_timings: bool = False  # CUDA events around each broadcast (static API only)
    #: ``nccl_direct`` waves (:mod:`~updater.transports.nccl.waves`): how long the first
    #: replica of a planned wave waits, paused, for the others to arrive (those that do not are
    #: sent alone); the replicas' own deadline on a wave's receive (a stuck wave frees them
    #: then, for a transfer alone: keep it well under the cycle's transfer deadline); the first
    #: rendezvous port of wave groups (None: right after every per-replica port,
    #: ``master_port + port_stride * max_incarnations``).
    wave_gather_s: float = Field(default=2.0, ge=0)
    wave_receive_timeout_s: float = Field(default=60.0, gt=0)
    wave_port: int | None = Field(default=None, ge=1024, le=65535)

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

    def wave_port_for(self, index: int, incarnation: int) -> int:
        """The rendezvous port of the ``incarnation``-th group of the ``index``-th wave (set of
        replicas) this transport has seen."""
        if incarnation >= self.max_incarnations:
            raise ValueError(f"wave {index}: more than {self.max_incarnations} groups abandoned")
        if index >= self.port_stride:
            raise ValueError(f"more than {self.port_stride} different waves")
        base = self.wave_port or self.master_port + self.port_stride * self.max_incarnations
        port = base + index + incarnation * self.port_stride
        if port > 65535:
            raise ValueError(f"wave {index}: rendezvous port {port} is out of range")
        return port
