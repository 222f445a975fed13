"""What :class:`rolloutpool.integrations.trl.PoolLink` records: the samples TRL trained on, the
updates it pushed, and the updates still in flight. No TRL import (usable without it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from updater.transports.ipc.pusher import StagedPush

__all__ = ["Sample", "Staged", "Submitted", "Update"]


@dataclass(frozen=True)
class Sample:
    """One completion TRL trained on, with its provenance."""

    step: int  # trainer global_step when it was generated
    rollout_id: str
    generation: int
    label: str
    replica: str
    identity_digest: str
    policy_step: int | None  # trainer step whose weights ``generation`` carries
    #: vLLM's weight_versions labels for this choice (== (label,)); None: the replica's vLLM
    #: reports none (before 0.32)
    spans: tuple[str, ...] | None
    completion_tokens: int


@dataclass(frozen=True)
class Update:
    """One pushed checkpoint and how it rolled over the replicas."""

    step: int
    generation: int
    label: str
    identity_digest: str
    update_id: str
    checkpoint: str
    stall_s: float  # time the training loop stood still in the callback for this push
    rolled_s: float | None = None  # push → every replica serves it (None while in flight)
    staging_copy_s: float | None = None  # weights_from="gpu_memory": the staging copy
    windows_s: dict[str, float] = field(default_factory=dict)  # per replica QUIESCED→READY

    @classmethod
    def of(cls, rec: dict[str, Any], step: int, checkpoint: object, **kw: Any) -> Update:
        """The update the updater's record ``rec`` describes."""
        gen, label, digest, uid = rec["generation"], rec["label"], rec["identity_digest"], rec["id"]
        return cls(step, int(gen), label, digest, uid, str(checkpoint), **kw)


@dataclass(frozen=True)
class Submitted:
    """An update the updater queued: its record, and when it was pushed."""

    record: dict[str, Any]
    pushed_at: float


@dataclass(frozen=True)
class Staged:
    """A push from GPU memory whose checkpoint, probe and submission run in the background."""

    push: StagedPush
    step: int
    pushed_at: float
    stall_s: float  # the callback's stall for this push
