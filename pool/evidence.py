"""Typed evidence for every external operation.

Adapters (the vLLM engine client, transports, the store) produce these frozen values; the pure
lifecycle controller (:mod:`pool.lifecycle`) consumes them and advances a replica only when the
evidence *proves* the step's postcondition (see each class's ``proves_*`` property). Nothing here
does I/O. Bare booleans never cross a module boundary where one of these fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from pool.types import Generation

if TYPE_CHECKING:
    from pool.checksum import Checksum


class FailureKind(StrEnum):
    NO_MUTATION = "no_mutation"  # proved: nothing changed; refuse and stay
    AMBIGUOUS = "ambiguous"  # may have changed: TAINTED


@dataclass(frozen=True)
class PauseEvidence:
    """``POST /pause?mode=...`` answered, then ``GET /is_paused`` was read back."""

    mode: str
    http_status: int
    is_paused: bool
    elapsed_s: float

    @property
    def proves_paused(self) -> bool:
        return self.http_status == 200 and self.is_paused


@dataclass(frozen=True)
class ResumeEvidence:
    """The engine answered that it is not paused: ``POST /resume`` with ``GET /is_paused`` read
    back, or (:meth:`pool.engine.VllmEngine.confirm_resumed`) ``GET /is_paused`` on an engine
    resumed earlier; ``http_status`` is that call's own status. ``process``: the serving
    process's identity read right after it (None where the engine reports none); RESUMING
    publishes a replica only if it is still the process that was validated."""

    http_status: int
    is_paused: bool
    elapsed_s: float = 0.0
    process: str | None = None

    @property
    def proves_resumed(self) -> bool:
        return self.http_status == 200 and not self.is_paused


@dataclass(frozen=True)
class DrainEvidence:
    """Both drain observations I2 requires: the store's and the engine's."""

    admissions_closed: bool  # the replica is not READY in the store (CAS committed)
    active_bindings: int  # the store's active count for the replica
    engine_paused: bool  # the engine reports itself paused (so drained of running work)
    engine_running: int = 0  # vLLM's num_requests_running, where scraped

    @property
    def proves_quiesced(self) -> bool:
        return (
            self.admissions_closed
            and self.active_bindings == 0
            and self.engine_paused
            and self.engine_running == 0
        )


@dataclass(frozen=True)
class CacheResetEvidence:
    """Results of the three cache resets; ``prefix`` is the body's ``success`` field."""

    prefix: bool
    multimodal: bool
    encoder: bool
    attempts: int = 1
    detail: str = ""

    @property
    def proves_reset(self) -> bool:
        return self.prefix and self.multimodal and self.encoder


@dataclass(frozen=True)
class TransferEvidence:
    """A transport reported the new weights loaded. ``identity_digest`` is what was sent.

    ``checksums``: the sender's :class:`pool.checksum.Checksum` per checkpoint tensor name,
    computed while sending (None: this transport offers none); validation then requires the
    replica's to be equal. ``checksum_s``: what computing them cost the sender.
    ``replica_checksums``: the replica's, where its receive computed them over its runtime
    parameters as the data landed (None: validation asks the replica for them)."""

    transport: str
    identity_digest: str
    ok: bool
    bytes: int = 0
    elapsed_s: float = 0.0
    detail: str = ""
    checksums: Mapping[str, Checksum] | None = None
    checksum_s: float = 0.0
    replica_checksums: Mapping[str, Checksum] | None = None


@dataclass(frozen=True)
class LabelEvidence:
    """The engine's weight-version label as read back (None where the server has no labels)."""

    supported: bool
    label: str | None


@dataclass(frozen=True)
class ChecksumEvidence:
    """The sender's per-parameter checksums compared with the replica's, computed over its
    runtime parameters after the load (:mod:`pool.checksum`). ``compared`` names were reported
    by both; ``mismatched`` differ, ``missing`` were sent but not reported, ``unexpected`` were
    reported but not sent; ``examples`` names a few of them. ``error``: the replica could not
    report (no worker extension, a failed call). Seconds: ``sender_s`` the sender's computation
    (overlapped with sending where the transport does so), ``replica_s`` the replica's call."""

    compared: int
    mismatched: int = 0
    missing: int = 0
    unexpected: int = 0
    examples: tuple[str, ...] = ()
    sender_s: float = 0.0
    replica_s: float = 0.0
    error: str = ""

    @property
    def proves_equal(self) -> bool:
        return (
            not self.error
            and self.compared > 0
            and self.mismatched == self.missing == self.unexpected == 0
        )

    @classmethod
    def compare(
        cls,
        expected: Mapping[str, Checksum],
        actual: Mapping[str, Checksum],
        *,
        sender_s: float = 0.0,
        replica_s: float = 0.0,
        error: str = "",
        limit: int = 8,
    ) -> ChecksumEvidence:
        """The sender's checksums (``expected``) against the replica's: every name sent must be
        reported with equal dtype, shape and sums, and the replica must report no other name
        (a parameter nobody sent holds weights nobody vouches for). Up to ``limit`` names of
        each kind of difference are kept."""
        mismatched = sorted(n for n in expected.keys() & actual.keys() if expected[n] != actual[n])
        missing = sorted(expected.keys() - actual.keys())
        unexpected = sorted(actual.keys() - expected.keys())
        return cls(
            compared=len(expected.keys() & actual.keys()),
            mismatched=len(mismatched),
            missing=len(missing),
            unexpected=len(unexpected),
            examples=tuple((mismatched + missing + unexpected)[:limit]),
            sender_s=sender_s,
            replica_s=replica_s,
            error=error,
        )


@dataclass(frozen=True)
class ValidationEvidence:
    """Validation, run while the replica is closed to admissions (the engine resumed for the
    probe with the store still saying VALIDATING and 0 active: no rollout can reach it).

    ``label`` is None where the server has no labels (vLLM 0.26). ``probe_expected`` is the
    reference output of the target checkpoint; ``probe_actual`` what the replica produced.
    ``checksums``: the comparison of the sender's checksums with the replica's, where the
    transfer offered them (None: it did not); when present it must prove equality.
    """

    generation: Generation
    label: LabelEvidence
    probe_expected: tuple[int, ...]
    probe_actual: tuple[int, ...]
    detail: str = ""
    checksums: ChecksumEvidence | None = None

    @property
    def label_ok(self) -> bool:
        return (not self.label.supported) or self.label.label == self.generation.label

    @property
    def checksums_ok(self) -> bool:
        return self.checksums is None or self.checksums.proves_equal

    @property
    def proves_valid(self) -> bool:
        return (
            self.label_ok
            and self.checksums_ok
            and len(self.probe_expected) > 0
            and self.probe_expected == self.probe_actual
        )


_SEP = " @ "  # between the two parts of an encoded ProcessIdentity


#: The engine identity recorded for a tainted process that was no longer running when its
#: recovery began: any process that reports an identity afterwards is another one.
GONE = "gone: not running when recovery began"


@dataclass(frozen=True)
class ProcessIdentity:
    """Which server process a replica is.

    ``engine`` is what the engine itself reports (:attr:`pool.engine.EngineMetrics.process`,
    its API server's start time). ``provider`` is the identity the replica's provider gives the
    process it runs (``updater.providers``: a Ray actor, a pod UID and container, a pid and its
    start time), None where the provider has none (a replica someone else runs).

    Stored in the replica's record as one string (:meth:`encode`, read back by :meth:`decode`);
    a record written before provider identities existed decodes to an engine-only identity.
    """

    engine: str
    provider: str | None = None

    def replaces(self, old: ProcessIdentity | None) -> bool:
        """Whether this is evidence of a *new* process in place of ``old`` (I6): the engine
        reports another process and, where ``old`` had a provider identity, the provider
        reports another one too. Nothing is evidence against an unknown one (``old`` None):
        whoever recovers a replica records the tainted process's identity first
        (:data:`GONE` where it no longer ran)."""
        if old is None:
            return False
        if self.engine == old.engine:
            return False
        return old.provider is None or (self.provider is not None and self.provider != old.provider)

    def encode(self) -> str:
        return self.engine if self.provider is None else f"{self.engine}{_SEP}{self.provider}"

    @classmethod
    def decode(cls, text: str | None) -> ProcessIdentity | None:
        if not text:
            return None
        engine, sep, provider = text.partition(_SEP)
        return cls(engine, provider if sep else None)

    def __str__(self) -> str:
        return self.encode()


@dataclass(frozen=True)
class BootstrapEvidence:
    """A (fresh) engine is up on ``generation``: it answered one real completion and validated.

    ``process`` is the serving process's identity (None: the engine did not report one);
    ``loaded`` says this bootstrap loaded the generation's weights into that process
    (rather than trusting what it was started with). Recovery (I6) needs both: a process other
    than the tainted one, and the weights loaded from scratch.
    """

    generation: Generation
    identity_digest: str
    engine_version: str
    validation: ValidationEvidence | None = None
    completion_ok: bool = False
    process: ProcessIdentity | None = None
    loaded: bool = False

    @property
    def proves_serving(self) -> bool:
        valid = self.validation is None or (
            self.validation.proves_valid and self.validation.generation == self.generation
        )
        return self.completion_ok and valid


@dataclass(frozen=True)
class StepFailed:
    """A step failed. ``kind`` says whether mutation is ruled out (stay) or possible (TAINT)."""

    step: str
    kind: FailureKind
    reason: str


@dataclass(frozen=True)
class DrainRequested:
    """The updater asks a READY replica to move to ``target``; admissions close at the CAS."""

    target: Generation
    target_identity: str


@dataclass(frozen=True)
class TransferStarted:
    """The updater is about to mutate weights (only legal from QUIESCED)."""

    identity_digest: str


@dataclass(frozen=True)
class UpdateCancelled:
    """The update was abandoned before any mutation; the engine was resumed on the old weights."""

    resumed: ResumeEvidence | None  # None: the engine was never paused


@dataclass(frozen=True)
class AdapterEvidence:
    """A LoRA generation was loaded beside the served ones on a READY replica and validated
    through its adapter (:mod:`pool.adapters`), while the older generations kept serving.

    ``listed`` says vLLM lists ``adapter`` as a model after the load; ``probe_actual`` is the
    greedy output of the probe sent with ``model`` = ``adapter`` and ``answered_model`` the
    ``model`` its answer named. ``process`` is the serving process's identity read after the
    probe (None: not reported); it must be the bootstrapped one, or the adapter was validated
    on a process the record does not vouch for. ``checksums``: the factors the replica's workers
    hold against the adapter directory's (:mod:`pool.adapter_sums`), where the pool compares
    them (None: not compared); they must be equal.
    """

    generation: Generation
    identity_digest: str
    adapter: str
    listed: bool
    probe_expected: tuple[int, ...]
    probe_actual: tuple[int, ...]
    answered_model: str | None
    process: str | None = None
    checksums: ChecksumEvidence | None = None

    @property
    def proves_admissible(self) -> bool:
        return (
            self.listed
            and self.answered_model == self.adapter
            and len(self.probe_expected) > 0
            and self.probe_expected == self.probe_actual
            and (self.checksums is None or self.checksums.proves_equal)
        )


@dataclass(frozen=True)
class RecoveryStarted:
    """A TAINTED replica is being replaced by a fresh process."""

    reason: str = ""


Event = (
    BootstrapEvidence
    | DrainRequested
    | DrainEvidence
    | TransferStarted
    | TransferEvidence
    | CacheResetEvidence
    | ValidationEvidence
    | ResumeEvidence
    | UpdateCancelled
    | StepFailed
    | RecoveryStarted
    | AdapterEvidence
)

__all__ = [
    "AdapterEvidence",
    "BootstrapEvidence",
    "CacheResetEvidence",
    "ChecksumEvidence",
    "DrainEvidence",
    "DrainRequested",
    "Event",
    "FailureKind",
    "LabelEvidence",
    "PauseEvidence",
    "RecoveryStarted",
    "ResumeEvidence",
    "StepFailed",
    "TransferEvidence",
    "TransferStarted",
    "UpdateCancelled",
    "ValidationEvidence",
]
