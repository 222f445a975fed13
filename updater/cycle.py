"""The per-replica cycle runner: drives the pure controller through one update (or bootstrap).

For one replica and one target generation::

    preflight (read-only)                     refused -> replica untouched, still READY
    READY -> DRAINING        fenced CAS: admissions close here (I1)
    wait until the store's active bindings are 0, at most ``drain_timeout_s`` (policy
                             ``wait``) or not at all (``abort``); what is left is aborted with
                             a reason (marked aborted in its provenance, never lost)
    POST /pause?clear_cache=false   DrainEvidence: store closed + 0 active; engine paused, idle
    DRAINING -> QUIESCED
    wait until every router verified the failover epoch (updater.failover, when a gate is set)
    QUIESCED -> UPDATING     (the store refuses both with active bindings: I2); the epoch must
                             not have moved since the routers' check
    transfer                 under its deadline (I5)
    UPDATING -> INVALIDATING reset prefix (body checked) + mm + encoder caches
    INVALIDATING -> VALIDATING  compare the sender's checksums with the replica's (where the
                             transfer offered them); set the label; resume the engine; probe;
                             read the label back
    VALIDATING -> RESUMING -> READY(g+1)        publishes g+1 if it is the first replica on it

Validation runs while the replica is *closed to admissions* (store state VALIDATING: routers
admit only READY, and its active count is 0). The engine itself is resumed for the probe,
because vLLM 0.26/0.32 silently queue requests sent to a paused engine (0.33 answers 503), so a
probe cannot run while the scheduler is paused; no rollout can reach the engine in that window.

Failures: before ``UPDATING`` every failure is "no mutation": the engine is resumed and the
replica returns to READY on its old generation (``UpdateCancelled``); if the resume cannot be
confirmed the replica is TAINTED. From ``UPDATING`` on, every failure — an exception, a deadline,
evidence that does not prove its step — is ambiguous: TAINTED (I4), never published.

One runner serves a whole pool; it is not safe to run two cycles on one replica concurrently
(the store's CAS would refuse the second anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from pool.checksum import compare as compare_checksums
from pool.checksum import from_json as checksums_from_json
from pool.engine import VllmEngine
from pool.errors import LifecycleError, RolloutPoolError, StoreConflict, StoreUnavailable
from pool.evidence import (
    BootstrapEvidence,
    ChecksumEvidence,
    DrainEvidence,
    DrainRequested,
    Event,
    FailureKind,
    LabelEvidence,
    ProcessIdentity,
    RecoveryStarted,
    ResumeEvidence,
    StepFailed,
    TransferEvidence,
    TransferStarted,
    UpdateCancelled,
    ValidationEvidence,
)
from pool.lifecycle import Lifecycle, advance
from pool.records import ReplicaOutcome, ReplicaReport
from pool.store import RedisStore, UpdaterLease
from pool.types import Generation, Manifest, ReplicaRecord, ReplicaState, WeightIdentity
from updater.deadline import bounded
from updater.failover import EpochGate
from updater.transports.base import Transport, WeightsTarget

log = logging.getLogger(__name__)
S = ReplicaState
T = TypeVar("T")


class DrainPolicy(StrEnum):
    """How a drain ends. Every drain ends: what is still bound when it ends is aborted with a
    reason (the binding's provenance says why), never dropped silently."""

    WAIT = "wait"  # let bindings end on their own, for at most drain_timeout_s
    ABORT = "abort"  # abort what is bound right away (fastest update; rollouts are cut)


class Deadlines(BaseModel):
    """Per-step deadlines in seconds (I5). Every engine call of a cycle runs under one."""

    preflight_s: float = Field(default=60.0, gt=0)
    pause_s: float = Field(default=60.0, gt=0)
    transfer_s: float = Field(default=300.0, gt=0)
    reset_s: float = Field(default=30.0, gt=0)
    validate_s: float = Field(default=60.0, gt=0)
    resume_s: float = Field(default=30.0, gt=0)


@dataclass(frozen=True)
class Probe:
    """A validation probe: greedy output of ``prompt_token_ids`` must equal ``expected``."""

    prompt_token_ids: tuple[int, ...]
    expected: tuple[int, ...]


@dataclass(frozen=True)
class UpdateTarget:
    generation: Generation
    identity: WeightIdentity
    path: Path
    probe: Probe


@dataclass
class ReplicaHandle:
    """The updater's view of one replica: its engine client, manifest and controller state.

    ``provider_identity`` reads the identity the replica's provider gives the process it runs
    now (:meth:`updater.providers.base.ReplicaProvider.incarnation`); None where there is none.
    """

    replica_id: str
    engine: VllmEngine
    manifest: Manifest
    lc: Lifecycle = field(default_factory=Lifecycle)
    provider_identity: Callable[[], Awaitable[str | None]] | None = None

    async def process(self, timeout_s: float) -> ProcessIdentity | None:
        """The serving process's identity now: the engine's report (None if it reports none)
        with the provider's. Raises :class:`~pool.errors.EngineError` when the engine does not
        answer within ``timeout_s``."""
        engine = (await self.engine.metrics(timeout_s=timeout_s)).process
        if engine is None:
            return None
        provider = await self.provider_identity() if self.provider_identity else None
        return ProcessIdentity(engine, provider)


Validator = Callable[["ReplicaHandle", Generation, "Probe"], Awaitable[ValidationEvidence]]


class CycleError(RolloutPoolError):
    """The cycle did not end READY on the target; ``report.outcome`` says where it ended."""

    code = "cycle_failed"

    def __init__(self, report: ReplicaReport) -> None:
        super().__init__(
            f"{report.replica}: {report.outcome}: {report.reason}",
            replica=report.replica,
            outcome=report.outcome,
        )
        self.report = report


#: Called with the report each time a phase begins (``report.phase`` names it) and once the
#: cycle ends; the updater persists it so a trainer can follow the update live.
Progress = Callable[[ReplicaReport], Awaitable[None]]


class _Timer:
    def __init__(self, report: ReplicaReport, progress: Progress | None) -> None:
        self.report, self.progress = report, progress

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    async def tell(self) -> None:
        """Report progress; a failure to report (Redis away) never fails the cycle."""
        if self.progress is not None:
            try:
                await self.progress(self.report)
            except RolloutPoolError as e:
                log.warning("progress of %s not recorded: %s", self.report.replica, e)


class _Phase:
    def __init__(self, timer: _Timer, name: str) -> None:
        self.timer, self.name = timer, name

    async def __aenter__(self) -> None:
        self.outer = self.timer.report.phase  # a phase inside another (checksum in validate)
        self.timer.report.phase = self.name
        await self.timer.tell()
        self.t0 = time.monotonic()

    async def __aexit__(self, *exc: object) -> None:
        self.timer.report.phases[self.name] = time.monotonic() - self.t0
        self.timer.report.phase = self.outer


class CycleRunner:
    """Runs update and bootstrap cycles; see the module docstring for the contract."""

    def __init__(
        self,
        store: RedisStore,
        lease: UpdaterLease,
        transport: Transport,
        *,
        deadlines: Deadlines | None = None,
        drain_policy: DrainPolicy = DrainPolicy.WAIT,
        drain_timeout_s: float = 300.0,
        drain_poll_s: float = 0.02,
        validator: Validator | None = None,
        gate: EpochGate | None = None,
        store_retry_s: float = 15.0,
    ) -> None:
        self.store = store
        self.lease = lease
        self.transport = transport
        self.deadlines = deadlines or Deadlines()
        self.drain_policy = drain_policy
        self.drain_timeout_s = drain_timeout_s
        self.drain_poll_s = drain_poll_s
        #: Produces the ValidationEvidence of a replica that already holds the new weights and
        #: has its caches reset; admissions stay closed. Default: :meth:`probe_validate` (label +
        #: greedy probe). A GPU harness on bf16 weights plugs in a teacher-forced log-prob check.
        self.validate: Validator = validator or self.probe_validate
        #: Stands before every transfer when Redis can fail over (:mod:`updater.failover`).
        self.gate = gate
        #: How long a commit or a read waits out Redis being unreachable (a failover) before
        #: the step fails; bounded anyway by the lease's local deadline.
        self.store_retry_s = store_retry_s

    # ------------------------------------------------------------------ engine steps

    async def _engine(
        self,
        step: str,
        call: Callable[[], Awaitable[T]],
        deadline_s: float,
        *,
        mutating: bool,
        fenced: bool = True,
    ) -> T:
        """One engine step under its deadline (I5). Redis writes are fenced by the store's
        scripts, engine calls are not: a ``fenced`` step (anything that changes the engine's
        state: pause, transfer, cache resets, label, resume) starts only while the updater lease
        cannot have lapsed (:meth:`pool.store.UpdaterLease.require`, else StaleFencingToken)."""
        if fenced:
            self.lease.require()
        return await bounded(step, call(), deadline_s, mutating=mutating)

    # ------------------------------------------------------------------ commits

    async def commit(self, h: ReplicaHandle, event: Event, *, reason: str = "") -> None:
        """Advance the controller, then commit the same move in the store (fenced CAS).

        Raises :class:`LifecycleError` (nothing written) if the controller refuses, and
        :class:`StoreConflict` if the store moved under us; a replica found TAINTED by someone
        else (a router's violation check, the health checker) is adopted as TAINTED. While
        Redis is unreachable (a failover) the commit is retried for up to ``store_retry_s``:
        the record read back afterwards tells a CAS that landed from one that did not.
        """
        before = h.lc
        after = advance(before, event)
        kw: dict[str, Any] = {"reason": reason or after.reason}
        if after.state is S.READY and after.generation is not None:
            kw.update(
                generation=after.generation,
                identity_digest=after.identity or "",
                publish=True,
                process=after.process.encode() if after.process else None,
            )
        if after.state is S.DRAINING and after.target is not None:
            kw.update(target=after.target, target_identity=after.target_identity or "")
        deadline = time.monotonic() + self.store_retry_s
        while True:
            token = self.lease.require()
            try:
                await self.store.transition(h.replica_id, token, before.state, after.state, **kw)
                break
            except StoreUnavailable:
                # Redis failing over: the CAS may or may not have landed (or been lost). Once
                # Redis answers again, the record says which: ours (same state, our token) is
                # done, the old state is retried, anything else is a conflict below.
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
                try:
                    rec = await self.store.replica(h.replica_id)
                except StoreUnavailable:
                    continue
                if rec.state is after.state and rec.fence == token:
                    break
                if rec.state is before.state:
                    continue
                exc: StoreConflict = StoreConflict(
                    f"replica {h.replica_id} is {rec.state}, expected {before.state}",
                    replica=h.replica_id,
                    state=rec.state,
                )
            except StoreConflict as e:
                exc = e
            rec = await self.store.replica(h.replica_id)
            if rec.state is S.TAINTED:
                h.lc = replace(before, state=S.TAINTED, reason=rec.reason)
            raise exc
        h.lc = after

    async def read(self, h: ReplicaHandle) -> ReplicaRecord:
        """The replica's record, waiting out Redis being unreachable for up to
        ``store_retry_s`` (a failover)."""
        deadline = time.monotonic() + self.store_retry_s
        while True:
            try:
                return await self.store.replica(h.replica_id)
            except StoreUnavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _taint(self, h: ReplicaHandle, step: str, exc: BaseException) -> None:
        """Move the replica to TAINTED (I4) after an ambiguous failure of ``step``."""
        reason = f"{step}: {type(exc).__name__}: {exc}"
        log.warning("tainting %s: %s", h.replica_id, reason)
        if h.lc.state is S.TAINTED:
            return
        try:
            await self.commit(h, StepFailed(step, FailureKind.AMBIGUOUS, reason), reason=reason)
        except StoreConflict:
            await self.store.taint(h.replica_id, reason, source="updater")
            h.lc = replace(h.lc, state=S.TAINTED, reason=reason)

    async def _cancel(
        self, h: ReplicaHandle, report: ReplicaReport, step: str, exc: BaseException, paused: bool
    ) -> CycleError:
        """No mutation happened: resume the engine and return to READY on the old generation."""
        report.reason = f"{step}: {exc}"
        try:
            res = (
                await self._engine(
                    "resume", lambda: h.engine.resume(), self.deadlines.resume_s, mutating=False
                )
                if paused
                else None
            )
            await self.commit(h, UpdateCancelled(res), reason=f"cancelled: {report.reason}")
            report.outcome = ReplicaOutcome.CANCELLED
        except Exception as e2:  # the resume could not be confirmed: the engine state is unknown
            await self._taint(h, "resume after cancel", e2)
            report.outcome = ReplicaOutcome.TAINTED
        return CycleError(report)

    # ------------------------------------------------------------------ the update cycle

    async def run(
        self, h: ReplicaHandle, t: UpdateTarget, progress: Progress | None = None
    ) -> ReplicaReport:
        """Update ``h`` to ``t``; returns the report on READY(t.generation), else raises
        :class:`CycleError` whose report says refused / cancelled / tainted. ``progress`` is
        told each phase as it begins."""
        report = ReplicaReport(replica=h.replica_id, generation=t.generation.number)
        timer = _Timer(report, progress)
        target = WeightsTarget(identity=t.identity, path=t.path, expected_manifest=h.manifest)
        d = self.deadlines

        async with timer("preflight"):
            try:
                await self._engine(
                    "preflight",
                    lambda: self.transport.preflight(h.engine, target),
                    d.preflight_s,
                    mutating=False,
                    fenced=False,
                )
            except Exception as e:
                report.outcome, report.reason = ReplicaOutcome.REFUSED, f"preflight: {e}"
                raise CycleError(report) from e

        async with timer("drain"):
            await self.commit(h, DrainRequested(t.generation, t.identity.digest))
            try:
                aborted = await self._wait_drained(h, report)
            except CycleError:
                raise
            except Exception as e:
                raise await self._cancel(h, report, "drain", e, paused=False) from e
            report.aborted_rollouts = aborted

        async with timer("pause"):
            try:
                # clear_cache=False: the INVALIDATING step's checked reset is the one that
                # counts (and the one the stale-cache proof exercises), not a side effect here.
                pause = await self._engine(
                    "pause",
                    lambda: h.engine.pause("abort" if aborted else "wait", clear_cache=False),
                    d.pause_s,
                    mutating=False,
                )
                running = (await h.engine.metrics()).requests_running
                rec = await self.read(h)
                drained = DrainEvidence(
                    admissions_closed=rec.state is S.DRAINING,
                    active_bindings=rec.active,
                    engine_paused=pause.proves_paused,
                    engine_running=running,
                )
                await self.commit(h, drained)
            except (StoreConflict, CycleError):
                raise
            except Exception as e:
                raise await self._cancel(h, report, "pause", e, paused=True) from e
        quiesced_at = time.monotonic()

        epoch = None
        if self.gate is not None:
            async with timer("routers"):
                try:  # no mutation yet: a failure here cancels like one in the pause step
                    epoch = await self.gate.settled()
                except Exception as e:
                    raise await self._cancel(h, report, "failover check", e, paused=True) from e
        step = "transfer"
        try:
            await self.commit(h, TransferStarted(t.identity.digest))
            if self.gate is not None and epoch is not None:
                await self.gate.unchanged(epoch)
            async with timer("transfer"):
                ev = await self._engine(
                    "transfer",
                    lambda: self.transport.transfer(h.engine, target),
                    d.transfer_s,
                    mutating=True,
                )
                await self.commit(h, ev)
            step = "invalidate"
            async with timer("invalidate"):
                reset = await self._engine(
                    "invalidate", lambda: h.engine.reset_caches(), d.reset_s, mutating=True
                )
                await self.commit(h, reset)
            step = "validate"
            async with timer("validate"):
                valid = await self._validate(h, t.generation, t.probe, ev, timer)
                await self.commit(h, valid)
            step = "resume"
            async with timer("resume"):
                paused = await self._engine(
                    "resume", lambda: h.engine.is_paused(), d.resume_s, mutating=True
                )
                await self.commit(h, ResumeEvidence(200, paused))
        except Exception as e:
            await self._taint(h, step, e)
            report.outcome, report.reason = (
                ReplicaOutcome.TAINTED,
                f"{step}: {type(e).__name__}: {e}",
            )
            raise CycleError(report) from e
        report.window_s = time.monotonic() - quiesced_at
        report.outcome = ReplicaOutcome.READY
        return report

    async def _wait_drained(self, h: ReplicaHandle, report: ReplicaReport) -> list[str]:
        """Wait for the replica's active bindings to reach 0, for at most ``drain_timeout_s``
        (policy ``wait``) or not at all (``abort``), then abort the rest with a reason. Returns
        the ids aborted."""
        wait_s = self.drain_timeout_s if self.drain_policy is DrainPolicy.WAIT else 0.0
        deadline = time.monotonic() + wait_s
        while True:
            rec = await self.read(h)
            if rec.state is S.TAINTED:
                h.lc = replace(h.lc, state=S.TAINTED, reason=rec.reason)
                report.outcome = ReplicaOutcome.TAINTED
                report.reason = f"tainted while draining: {rec.reason}"
                raise CycleError(report)
            if rec.active == 0:
                return []
            if time.monotonic() >= deadline:
                why = (
                    f"drain ended after {wait_s:g} s (policy=wait): aborted so the update of "
                    f"{h.replica_id} can proceed"
                    if self.drain_policy is DrainPolicy.WAIT
                    else f"aborted by the update of {h.replica_id} (drain policy=abort)"
                )
                return await self.store.abort_active(h.replica_id, why)
            await asyncio.sleep(self.drain_poll_s)

    async def _validate(
        self,
        h: ReplicaHandle,
        gen: Generation,
        probe: Probe,
        transfer: TransferEvidence | None,
        timer: _Timer,
    ) -> ValidationEvidence:
        """The VALIDATING step: where the transfer offered the sender's checksums, the replica's
        are compared first (phase ``checksum``; a difference ends validation there, the engine
        never resumed on those weights), then :attr:`validate` (probe, label)."""
        d = self.deadlines
        sums = None
        if transfer is not None and transfer.checksums is not None:
            async with timer("checksum"):
                sums = await self._engine(
                    "checksum",
                    lambda: self.verify_checksums(h, transfer),
                    d.validate_s,
                    mutating=True,
                )
            if not sums.proves_equal:
                return ValidationEvidence(
                    gen,
                    LabelEvidence(False, None),
                    (),
                    (),
                    detail="probe not run: the checksums differ",
                    checksums=sums,
                )
        valid = await self._engine(
            "validate", lambda: self.validate(h, gen, probe), d.validate_s, mutating=True
        )
        return valid if sums is None else replace(valid, checksums=sums)

    async def verify_checksums(
        self, h: ReplicaHandle, transfer: TransferEvidence
    ) -> ChecksumEvidence:
        """The replica's checksums over its runtime parameters against the sender's: those its
        receive reported (``transfer.replica_checksums``), else the worker extension's
        ``rolloutpool_checksums`` now (:mod:`pool.replica_extension`). A replica that cannot
        answer (no extension loaded, an error) yields evidence with ``error`` set, which does
        not prove equality."""
        expected = transfer.checksums or {}
        if transfer.replica_checksums is not None:
            return compare_checksums(
                expected, transfer.replica_checksums, sender_s=transfer.checksum_s
            )
        t0 = time.monotonic()
        try:
            rpc = await h.engine.collective_rpc(
                "rolloutpool_checksums", timeout_s=self.deadlines.validate_s
            )
            if len(rpc.results) != 1 or not isinstance(rpc.results[0], dict):
                raise ValueError(f"one result per worker expected, got {rpc.results!r:.200}")
            actual = checksums_from_json(rpc.results[0].get("checksums"))
        except Exception as e:
            return compare_checksums(
                expected,
                {},
                sender_s=transfer.checksum_s,
                replica_s=time.monotonic() - t0,
                error=f"{type(e).__name__}: {e}"[:500],
            )
        return compare_checksums(
            expected, actual, sender_s=transfer.checksum_s, replica_s=time.monotonic() - t0
        )

    async def probe_validate(
        self, h: ReplicaHandle, gen: Generation, probe: Probe
    ) -> ValidationEvidence:
        """Label, resume (admissions stay closed), probe, read the label back."""
        caps = h.engine.capabilities
        if caps.labels:
            await h.engine.set_label(gen.label)
        await h.engine.resume()
        actual = await h.engine.complete(
            list(probe.prompt_token_ids),
            max_tokens=len(probe.expected),
            temperature=0.0,
            cache_salt=gen.label,
        )
        label = await h.engine.weight_label() if caps.labels else LabelEvidence(False, None)
        return ValidationEvidence(gen, label, probe.expected, actual)

    # ------------------------------------------------------------------ bootstrap / recovery

    async def bootstrap(
        self,
        h: ReplicaHandle,
        generation: Generation,
        identity: WeightIdentity,
        probe: Probe,
        checkpoint: Path | None,
    ) -> ReplicaReport:
        """Bring a fresh engine (UNINITIALIZED or RECOVERING) to READY on ``generation``.

        ``checkpoint`` is loaded first (None: trust what the process was started with, only for a
        replica joining for the first time; recovery always loads, I6). The engine must not be
        serving anyone (the store keeps it closed to admissions until the final commit). The
        server process's identity (the engine's and the provider's, :meth:`ReplicaHandle.process`)
        is read before the load and again after validation; a change in between (a restart
        mid-bootstrap) is a failure. Any failure: TAINTED.
        """
        report = ReplicaReport(replica=h.replica_id, generation=generation.number)
        timer = _Timer(report, None)
        d = self.deadlines
        step = "bootstrap"
        loaded: TransferEvidence | None = None
        try:
            async with timer("bootstrap"):
                caps = await self._engine(
                    "bootstrap",
                    lambda: h.engine.bootstrap(),
                    d.resume_s,
                    mutating=False,
                    fenced=False,
                )
                process = await h.process(d.resume_s)
            if checkpoint is not None:
                target = WeightsTarget(
                    identity=identity, path=checkpoint, expected_manifest=h.manifest
                )
                step = "load"
                async with timer("load"):
                    await self._engine(
                        "preflight",
                        lambda: self.transport.preflight(h.engine, target),
                        d.preflight_s,
                        mutating=False,
                        fenced=False,
                    )
                    await self._engine(
                        "pause", lambda: h.engine.pause("wait"), d.pause_s, mutating=True
                    )
                    loaded = await self._engine(
                        "transfer",
                        lambda: self.transport.transfer(h.engine, target),
                        d.transfer_s,
                        mutating=True,
                    )
                    if not loaded.ok:
                        raise LifecycleError(f"transfer failed: {loaded.detail}")
            step = "invalidate"
            async with timer("invalidate"):
                reset = await self._engine(
                    "invalidate", lambda: h.engine.reset_caches(), d.reset_s, mutating=True
                )
                if not reset.proves_reset:
                    raise LifecycleError(f"cache reset not proven: {reset.detail}")
            step = "validate"
            async with timer("validate"):
                valid = await self._validate(h, generation, probe, loaded, timer)
            if await h.process(d.resume_s) != process:
                raise LifecycleError("the server process changed during the bootstrap")
            ev_boot = BootstrapEvidence(
                generation,
                identity.digest,
                caps.version,
                valid,
                completion_ok=True,
                process=process,
                loaded=checkpoint is not None,
            )
            step = "commit"
            await self.commit(h, ev_boot)
        except Exception as e:
            if h.lc.state is not S.TAINTED:
                await self._taint(h, step, e)
            report.outcome, report.reason = (
                ReplicaOutcome.TAINTED,
                f"{step}: {type(e).__name__}: {e}",
            )
            raise CycleError(report) from e
        report.outcome = ReplicaOutcome.READY
        return report

    async def start_recovery(self, h: ReplicaHandle, reason: str) -> None:
        """TAINTED -> RECOVERING (the caller then restarts the process and calls bootstrap)."""
        await self.commit(h, RecoveryStarted(reason), reason=reason)
