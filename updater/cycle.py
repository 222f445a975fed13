"""The per-replica cycle runner: drives the pure controller through one update (or bootstrap).

For one replica and one target generation::

    preflight (read-only)                     refused -> replica untouched, still READY
    READY -> DRAINING        fenced CAS: admissions close here (I1)
    wait until the store's active bindings and routers' granted slots are 0, at most
                             ``drain_timeout_s`` (policy
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

Around it: what a cycle runs on (:mod:`updater.handle`), each move committed in the store
across failovers (:mod:`updater.commits`, the runner's base), the evidence of VALIDATING
(:mod:`updater.validation`), the configuration (:mod:`updater.config`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from pool.errors import (
    EpochChanged,
    LifecycleError,
    RolloutPoolError,
    StoreConflict,
    StoreUnavailable,
)
from pool.evidence import (
    BootstrapEvidence,
    DrainEvidence,
    DrainRequested,
    LabelEvidence,
    RecoveryStarted,
    TransferEvidence,
    TransferStarted,
    UpdateCancelled,
    ValidationEvidence,
)
from pool.records import ReplicaOutcome, ReplicaReport
from pool.store import Epoch, RedisStore, UpdaterLease
from pool.types import Generation, ReplicaState, WeightIdentity
from updater.commits import Commits
from updater.config import Deadlines, DrainPolicy
from updater.deadline import bounded
from updater.drains import DrainReads
from updater.failover import EpochGate
from updater.handle import Probe, ReplicaHandle, UpdateTarget
from updater.transports.base import Transport, WeightsTarget
from updater.validation import Validator, probe_validate, verify_checksums

__all__ = [
    "CycleError",
    "CycleRunner",
    "Deadlines",
    "DrainPolicy",
    "Probe",
    "Progress",
    "ReplicaHandle",
    "UpdateTarget",
]

log = logging.getLogger(__name__)
S = ReplicaState
T = TypeVar("T")


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


class CycleRunner(Commits):
    """Runs update and bootstrap cycles; see the module docstring for the contract. Its
    commits and reads of replica records are :class:`~updater.commits.Commits`'."""

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
        super().__init__(store, lease, store_retry_s)
        self.transport = transport
        self.deadlines = deadlines or Deadlines()
        self.drain_policy = drain_policy
        self.drain_timeout_s = drain_timeout_s
        #: every drain's reads of its replica's record, ``drain_poll_s`` apart, one store call
        #: per tick for all of them
        self.drains = DrainReads(
            lambda ids: self.retrying(lambda: self.store.replicas_of(ids)), drain_poll_s
        )
        #: The probe part of validation (:data:`updater.validation.Validator`). Default:
        #: :func:`~updater.validation.probe_validate` (label + greedy probe). A GPU harness on
        #: bf16 weights plugs in a teacher-forced log-prob check.
        self.validate: Validator = validator or probe_validate
        #: Stands before every transfer when Redis can fail over (:mod:`updater.failover`).
        self.gate = gate

    # ------------------------------------------------------------------ the transport's state

    def expect_wave(self, handles: Collection[ReplicaHandle]) -> None:
        """The next cycles update ``handles`` concurrently to one target (a wave of the rolling
        plan); the transport may send the wave one copy (:meth:`Transport.expect_wave`)."""
        self.transport.expect_wave([h.engine.url for h in handles])

    def forget(self, h: ReplicaHandle) -> None:
        """``h``'s process was or is about to be replaced: the transport drops what it keeps for
        the old one (e.g. an NCCL group; :meth:`Transport.forget`)."""
        self.transport.forget(h.engine.url)

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
                    active_bindings=rec.busy,
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
            await self._enter_updating(h, t.identity.digest, epoch)
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
                resumed = await self._engine(
                    "resume", lambda: h.engine.confirm_resumed(), d.resume_s, mutating=True
                )
                await self.commit(h, resumed)
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

    async def _enter_updating(
        self, h: ReplicaHandle, identity_digest: str, epoch: Epoch | None
    ) -> None:
        """QUIESCED -> UPDATING, and with an epoch gate, proof that Redis did not fail over
        between the routers' check of ``epoch`` and that commit (:mod:`updater.failover`).

        The commit checked 0 active bindings on one primary; a failover in between could have
        lost bindings routers still serve. No weight has moved yet, so a failover here (or
        Redis restarting) is waited out instead of tainting: once the new epoch is settled and
        every router verified it, the record is read again in it. UPDATING with our token (and
        the commit's check held there: 0 active) goes on; the commit lost (QUIESCED again) is
        made again; anything else is a StoreConflict. Bounded by the gate's timeout."""
        await self.commit(h, TransferStarted(identity_digest))
        if self.gate is None or epoch is None:
            return
        deadline = time.monotonic() + self.gate.timeout_s
        while True:
            try:
                await self.gate.unchanged(epoch)
                return
            except (EpochChanged, StoreUnavailable) as e:
                if time.monotonic() >= deadline:
                    raise
                log.warning("%s: %s before the transfer; checking again", h.replica_id, e)
            epoch = await self.gate.settled()
            rec = await self.read(h)
            if rec.state is S.QUIESCED and h.lc.state is S.UPDATING:
                h.lc = replace(h.lc, state=S.QUIESCED)  # the failover lost our commit
                await self.commit(h, TransferStarted(identity_digest))
            elif rec.state is not S.UPDATING or rec.fence != self.lease.require():
                raise StoreConflict(
                    f"replica {h.replica_id} is {rec.state} after a failover, expected UPDATING",
                    replica=h.replica_id,
                    state=rec.state,
                )
            elif rec.busy:
                raise StoreConflict(
                    f"replica {h.replica_id} has {rec.busy} active bindings or granted slots "
                    "after a failover",
                    replica=h.replica_id,
                    active=rec.busy,
                )

    async def _wait_drained(self, h: ReplicaHandle, report: ReplicaReport) -> list[str]:
        """Wait for the replica's active bindings and the slots routers hold on it (grants) to
        reach 0, for at most ``drain_timeout_s`` (policy ``wait``) or not at all (``abort``),
        then abort the rest with a reason. Returns the binding ids aborted.

        Routers return their grants as soon as what runs under them was delivered (they hear
        of DRAINING on the change feed). An abort ends the bindings at once and tells the
        routers to cut what runs under their grants; the grants are then waited for, at most
        ``failover_grace_s`` more (a router that cannot be reached that long has lost its
        registration, and its grants with it: it cut its requests itself)."""
        wait_s = self.drain_timeout_s if self.drain_policy is DrainPolicy.WAIT else 0.0
        deadline = time.monotonic() + wait_s
        aborted: list[str] | None = None
        while True:
            rec = await self.drains.next(h.replica_id)
            if rec.state is S.TAINTED:
                h.lc = replace(h.lc, state=S.TAINTED, reason=rec.reason)
                report.outcome = ReplicaOutcome.TAINTED
                report.reason = f"tainted while draining: {rec.reason}"
                raise CycleError(report)
            if rec.busy == 0:
                return aborted or []
            if aborted is None and time.monotonic() >= deadline:
                why = (
                    f"drain ended after {wait_s:g} s (policy=wait): aborted so the update of "
                    f"{h.replica_id} can proceed"
                    if self.drain_policy is DrainPolicy.WAIT
                    else f"aborted by the update of {h.replica_id} (drain policy=abort)"
                )
                aborted = await self.store.abort_active(h.replica_id, why)
                # routers return grants they cut; a dead router's lapse with its registration
                deadline = time.monotonic() + 2 * self.store.settings.failover_grace_s
            elif aborted is not None and time.monotonic() >= deadline:
                return aborted  # the commit to QUIESCED counts again (and refuses if held)

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
                    lambda: verify_checksums(h, transfer, d.validate_s),
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
