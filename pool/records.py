"""Update records: what the updater writes into the store and every reader (the updater's API,
the router's dashboard, benchmarks) reads back through these types. No I/O.

An :class:`UpdateRecord` follows one pushed checkpoint from ``queued`` to a final
:class:`UpdateState`; it holds one :class:`ReplicaReport` per replica the rolling plan touched.
The report is mutable while its cycle runs (the cycle runner fills in phases as they end) and is
final once its :class:`ReplicaOutcome` is no longer ``running``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_serializer


class ReplicaOutcome(StrEnum):
    """How one replica's update (or bootstrap) cycle ended."""

    RUNNING = "running"  # not ended yet
    READY = "ready"  # READY on the target generation
    REFUSED = "refused"  # preflight refused the checkpoint; the replica was not touched
    CANCELLED = "cancelled"  # stopped before any mutation; READY again on its old generation
    TAINTED = "tainted"  # ambiguous failure: TAINTED, only recovery brings it back (I4, I6)
    FAILED = "failed"  # the cycle could not run (a lost compare-and-set); state left as found


class ReplicaReport(BaseModel):
    """One replica's cycle: outcome, the reason when not ``ready``, seconds per phase, the update
    window (QUIESCED → READY) and the rollouts a drain deadline aborted."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    replica: str
    generation: int
    outcome: ReplicaOutcome = ReplicaOutcome.RUNNING
    reason: str = ""
    phase: str | None = None  # the phase running now (None: between phases, or ended)
    phases: dict[str, float] = Field(default_factory=dict)  # seconds of each phase that ended
    window_s: float | None = None
    aborted_rollouts: list[str] = Field(default_factory=list)

    @field_serializer("phases")
    def _round_phases(self, phases: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 4) for k, v in phases.items()}

    @field_serializer("window_s")
    def _round_window(self, window_s: float | None) -> float | None:
        return None if window_s is None else round(window_s, 4)


class UpdateState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUPERSEDED = "superseded"  # a newer update was queued before this one started

    @property
    def final(self) -> bool:
        return self not in (UpdateState.QUEUED, UpdateState.RUNNING)


class UpdateRecord(BaseModel):
    """One pushed checkpoint's rolling update, as stored under ``{ns}:updates``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    id: str
    state: UpdateState
    generation: int
    label: str
    checkpoint: str
    identity_digest: str
    created_ms: int  # pushed
    started_ms: int | None = None  # the roll began (earlier updates had finished)
    published_ms: int | None = None  # the first replica was READY on it: admissions began
    rolled_ms: int | None = None  # every replica in service was READY on it
    finished_ms: int | None = None
    #: push → every replica in service on this generation (rolled_ms - created_ms): how long
    #: rollouts could still be served by an older generation; None until rolled
    staleness_window_s: float | None = None
    replicas: dict[str, ReplicaReport] = Field(default_factory=dict)
    error: str = ""


__all__ = ["ReplicaOutcome", "ReplicaReport", "UpdateRecord", "UpdateState"]
