"""The replica lifecycle controller: pure, no I/O, no vLLM import.

Rules of this module:

* Everything that decides a transition lives here: the table :data:`TRANSITIONS` and the guards.
* :func:`advance` is a pure function ``(Lifecycle, Event) -> Lifecycle``. It never mutates its
  input; a refused event raises and the caller's value is simply still the current one.
* A step advances only on evidence that proves its postcondition (``proves_*`` on the evidence
  types). Evidence that does not prove it raises :class:`~pool.errors.PostconditionFailed` — for
  instance a prefix-cache reset whose body said ``success: false``.
* Failures are classified by :class:`~pool.evidence.StepFailed`: ``NO_MUTATION`` is refused and
  leaves the state where it is (the caller may retry or cancel); ``AMBIGUOUS`` moves any state to
  ``TAINTED`` (I4). ``TAINTED`` is left only through ``RECOVERING`` and a fresh bootstrap (I6).

The happy path (invariants I2 and I3 fall out of it being the only path to a new generation)::

    UNINITIALIZED --BootstrapEvidence--> READY --DrainRequested--> DRAINING
    DRAINING --DrainEvidence--> QUIESCED --TransferStarted--> UPDATING
    UPDATING --TransferEvidence--> INVALIDATING --CacheResetEvidence--> VALIDATING
    VALIDATING --ValidationEvidence--> RESUMING --ResumeEvidence--> READY (target generation)
    READY --AdapterEvidence--> READY (a newer LoRA generation loaded beside the old, no drain)
    DRAINING | QUIESCED --UpdateCancelled--> READY (old generation)
    * --StepFailed(AMBIGUOUS)--> TAINTED --RecoveryStarted--> RECOVERING
    RECOVERING --BootstrapEvidence--> READY   (only from a new process, weights loaded: I6)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pool.errors import IllegalTransition, PostconditionFailed
from pool.evidence import (
    AdapterEvidence,
    BootstrapEvidence,
    CacheResetEvidence,
    DrainEvidence,
    DrainRequested,
    Event,
    FailureKind,
    ProcessIdentity,
    RecoveryStarted,
    ResumeEvidence,
    StepFailed,
    TransferEvidence,
    TransferStarted,
    UpdateCancelled,
    ValidationEvidence,
)
from pool.types import Generation, ReplicaState

S = ReplicaState


@dataclass(frozen=True)
class Lifecycle:
    """One replica's controller state.

    ``generation``/``identity`` are what the replica serves (meaningful in READY; kept as "last
    known" elsewhere, never trusted in TAINTED). ``process`` is the identity of the server
    process that was bootstrapped (kept through TAINTED and RECOVERING: recovery must prove a
    different one, :meth:`~pool.evidence.ProcessIdentity.replaces`). ``target`` and
    ``target_identity`` are set from DRAINING until the update ends.
    """

    state: ReplicaState = S.UNINITIALIZED
    generation: Generation | None = None
    identity: str | None = None
    process: ProcessIdentity | None = None
    target: Generation | None = None
    target_identity: str | None = None
    reason: str = ""


#: A guard checks that ``event`` proves its step and returns the lifecycle's new fields; the
#: ``state`` it returns is ignored: :data:`TRANSITIONS` alone assigns the next state.
Guard = Callable[[Lifecycle, Event], Lifecycle]

# state -> event type -> the next state. A missing entry is an IllegalTransition. This table is
# the only place that assigns a next state (``advance`` applies it to what the guard returns).
TRANSITIONS: dict[ReplicaState, dict[type, ReplicaState]] = {
    S.UNINITIALIZED: {BootstrapEvidence: S.READY},
    S.READY: {DrainRequested: S.DRAINING, AdapterEvidence: S.READY},
    S.DRAINING: {DrainEvidence: S.QUIESCED, UpdateCancelled: S.READY},
    S.QUIESCED: {TransferStarted: S.UPDATING, UpdateCancelled: S.READY},
    S.UPDATING: {TransferEvidence: S.INVALIDATING},
    S.INVALIDATING: {CacheResetEvidence: S.VALIDATING},
    S.VALIDATING: {ValidationEvidence: S.RESUMING},
    S.RESUMING: {ResumeEvidence: S.READY},
    S.TAINTED: {RecoveryStarted: S.RECOVERING},
    S.RECOVERING: {BootstrapEvidence: S.READY},
}


#: The states of an update in progress, DRAINING through RESUMING: the replica is out of
#: admission on its way to the target generation (the rolling plan counts them as unavailable).
IN_UPDATE: frozenset[ReplicaState] = frozenset(
    {S.DRAINING, S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING, S.RESUMING}
)


def _refuse(lc: Lifecycle, event: Event, why: str) -> PostconditionFailed:
    return PostconditionFailed(
        f"{type(event).__name__} does not prove the postcondition in {lc.state}: {why}",
        state=str(lc.state),
        event=type(event).__name__,
    )


def _probe(v: ValidationEvidence) -> str:
    """``probe_matches=...``, with both token lists (their first 8) when they differ."""
    if v.probe_expected == v.probe_actual:
        return "probe_matches=True"
    return (
        f"probe_matches=False (expected {list(v.probe_expected[:8])}, "
        f"got {list(v.probe_actual[:8])})"
    )


def _bootstrap(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, BootstrapEvidence)
    if not ev.proves_serving:
        v = ev.validation
        why = "no successful completion" if not ev.completion_ok else "validation failed"
        if v is not None:
            why += f": label_ok={v.label_ok} {_probe(v)} checksums={v.checksums}"
        raise _refuse(lc, ev, why)
    if lc.state is S.RECOVERING:  # I6: a fresh process, the weights loaded from scratch
        if ev.process is None or not ev.process.replaces(lc.process):
            raise _refuse(
                lc, ev, f"no evidence of a new process (was {lc.process}, now {ev.process})"
            )
        if not ev.loaded:
            raise _refuse(lc, ev, "the generation's weights were not loaded from scratch")
    return Lifecycle(generation=ev.generation, identity=ev.identity_digest, process=ev.process)


def _drain_requested(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, DrainRequested)
    cur = lc.generation
    if cur is not None and ev.target.number <= cur.number:
        raise _refuse(lc, ev, f"target g{ev.target.number} is not newer than g{cur.number}")
    return replace(lc, target=ev.target, target_identity=ev.target_identity, reason="")


def _drained(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, DrainEvidence)
    if not ev.proves_quiesced:
        raise _refuse(
            lc,
            ev,
            f"admissions_closed={ev.admissions_closed} active={ev.active_bindings} "
            f"engine_paused={ev.engine_paused} engine_running={ev.engine_running}",
        )
    return lc


def _cancelled(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, UpdateCancelled)
    if ev.resumed is not None and not ev.resumed.proves_resumed:
        raise _refuse(lc, ev, "engine did not confirm resume")
    return replace(lc, target=None, target_identity=None, reason="cancelled")


def _transfer_started(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, TransferStarted)
    if ev.identity_digest != lc.target_identity:
        raise _refuse(lc, ev, "transfer identity differs from the declared target")
    return lc


def _transferred(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, TransferEvidence)
    if not ev.ok:
        raise _refuse(lc, ev, f"transport reported failure: {ev.detail}")
    if ev.identity_digest != lc.target_identity:
        raise _refuse(lc, ev, "loaded identity differs from the declared target")
    return lc


def _reset(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, CacheResetEvidence)
    if not ev.proves_reset:
        raise _refuse(
            lc, ev, f"prefix={ev.prefix} mm={ev.multimodal} encoder={ev.encoder} {ev.detail}"
        )
    return lc


def _validated(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, ValidationEvidence)
    if ev.generation != lc.target:
        raise _refuse(lc, ev, "validated a generation other than the target")
    if not ev.proves_valid:
        raise _refuse(
            lc,
            ev,
            f"label_ok={ev.label_ok} {_probe(ev)} checksums={ev.checksums} {ev.detail}",
        )
    return lc


def _resumed(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, ResumeEvidence)
    if not ev.proves_resumed:
        raise _refuse(lc, ev, f"http={ev.http_status} is_paused={ev.is_paused}")
    if ev.process is not None and lc.process is not None and ev.process != lc.process.engine:
        raise _refuse(
            lc,
            ev,
            f"the server process changed since it was validated ({lc.process} -> "
            f"{ev.process}): its weights are not the ones validated",
        )
    return Lifecycle(generation=lc.target, identity=lc.target_identity, process=lc.process)


def _adapter(lc: Lifecycle, ev: Event) -> Lifecycle:
    """A LoRA generation joins a READY replica: the base weights are untouched (I2 holds: no
    weight of a generation already served changes) and every request names its adapter, so
    the replica admits the newer generation from here while bindings on older ones finish."""
    assert isinstance(ev, AdapterEvidence)
    cur = lc.generation
    if cur is None or ev.generation.number <= cur.number:
        raise _refuse(lc, ev, f"g{ev.generation.number} is not newer than {cur}")
    if not ev.proves_admissible:
        raise _refuse(
            lc,
            ev,
            f"listed={ev.listed} answered_model={ev.answered_model!r} (sent {ev.adapter!r}) "
            f"probe {list(ev.probe_actual[:8])} expected {list(ev.probe_expected[:8])} "
            f"checksums {ev.checksums}",
        )
    if ev.process is not None and lc.process is not None and ev.process != lc.process.engine:
        raise _refuse(
            lc, ev, f"the server process changed ({lc.process} -> {ev.process}) since bootstrap"
        )
    return Lifecycle(generation=ev.generation, identity=ev.identity_digest, process=lc.process)


def _recovery(lc: Lifecycle, ev: Event) -> Lifecycle:
    assert isinstance(ev, RecoveryStarted)
    return replace(lc, reason=ev.reason or lc.reason)


GUARDS: dict[type, Guard] = {
    BootstrapEvidence: _bootstrap,
    DrainRequested: _drain_requested,
    DrainEvidence: _drained,
    UpdateCancelled: _cancelled,
    TransferStarted: _transfer_started,
    TransferEvidence: _transferred,
    CacheResetEvidence: _reset,
    ValidationEvidence: _validated,
    ResumeEvidence: _resumed,
    RecoveryStarted: _recovery,
    AdapterEvidence: _adapter,
}


def advance(lc: Lifecycle, event: Event) -> Lifecycle:
    """Return the lifecycle after ``event``, or raise; ``lc`` itself is never changed.

    Raises :class:`IllegalTransition` when the table has no entry for the event in this state,
    :class:`PostconditionFailed` when the evidence does not prove the step, and also when a
    ``NO_MUTATION`` failure is reported (refused: the caller stays, retries or cancels).
    """
    if isinstance(event, StepFailed):
        if event.kind is FailureKind.AMBIGUOUS:
            return replace(lc, state=S.TAINTED, reason=f"{event.step}: {event.reason}")
        raise PostconditionFailed(
            f"{event.step} failed without mutation in {lc.state}: {event.reason}",
            state=str(lc.state),
            step=event.step,
        )
    nxt = TRANSITIONS[lc.state].get(type(event))
    if nxt is None:
        raise IllegalTransition(
            f"can't handle {type(event).__name__} in state {lc.state}",
            state=str(lc.state),
            event=type(event).__name__,
        )
    return replace(GUARDS[type(event)](lc, event), state=nxt)
