"""The pure lifecycle controller: table walk, postconditions, failure classification."""

from __future__ import annotations

import dataclasses

import pytest

from pool.errors import IllegalTransition, PostconditionFailed
from pool.evidence import (
    GONE,
    BootstrapEvidence,
    CacheResetEvidence,
    ChecksumEvidence,
    DrainEvidence,
    DrainRequested,
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
from pool.lifecycle import TRANSITIONS, Lifecycle, advance
from pool.types import Generation, ReplicaState

S = ReplicaState
G0, G1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")
PROBE = (5, 6, 7)
P0, P1 = ProcessIdentity("p0"), ProcessIdentity("p1")


def boot(gen: Generation = G0, ident: str = "id0") -> BootstrapEvidence:
    return BootstrapEvidence(gen, ident, "0.32.0", completion_ok=True, process=P0)


def valid(
    gen: Generation = G1, actual: tuple[int, ...] = PROBE, label: str | None = "g1"
) -> ValidationEvidence:
    return ValidationEvidence(gen, LabelEvidence(True, label), PROBE, actual)


def happy_path() -> list[tuple[object, ReplicaState]]:
    return [
        (boot(), S.READY),
        (DrainRequested(G1, "id1"), S.DRAINING),
        (DrainEvidence(True, 0, True), S.QUIESCED),
        (TransferStarted("id1"), S.UPDATING),
        (TransferEvidence("reload", "id1", ok=True), S.INVALIDATING),
        (CacheResetEvidence(True, True, True), S.VALIDATING),
        (valid(), S.RESUMING),
        (ResumeEvidence(200, False), S.READY),
    ]


def walk(upto: ReplicaState) -> Lifecycle:
    lc = Lifecycle()
    for ev, st in happy_path():
        if lc.state is upto:
            return lc
        lc = advance(lc, ev)  # type: ignore[arg-type]
        assert lc.state is st
    return lc


def test_a_process_replaced_after_validation_is_not_published() -> None:
    """Found by the fault matrix: a replica restarted by its orchestrator between VALIDATING
    and the READY commit answered is_paused=false (a fresh process is not paused) and was
    published on the validated generation while it served what it was started with."""
    lc = walk(S.RESUMING)
    assert lc.process == P0  # the bootstrapped process, carried through the update
    with pytest.raises(PostconditionFailed, match="server process changed"):
        advance(lc, ResumeEvidence(200, False, process="p1"))
    assert advance(lc, ResumeEvidence(200, False, process="p0")).state is S.READY


def test_happy_path_ends_ready_on_target() -> None:
    lc = Lifecycle()
    for ev, st in happy_path():
        lc = advance(lc, ev)  # type: ignore[arg-type]
        assert lc.state is st
    assert lc.generation == G1 and lc.identity == "id1" and lc.target is None


@pytest.mark.parametrize(
    ("state", "bad"),
    [
        (S.DRAINING, DrainEvidence(True, 1, True)),  # a binding is still active
        (S.DRAINING, DrainEvidence(True, 0, False)),  # engine not paused
        (S.DRAINING, DrainEvidence(False, 0, True)),  # admissions not closed
        (S.DRAINING, DrainEvidence(True, 0, True, engine_running=2)),
        (S.QUIESCED, TransferStarted("other")),
        (S.UPDATING, TransferEvidence("reload", "id1", ok=False)),
        (S.UPDATING, TransferEvidence("reload", "wrong", ok=True)),
        (S.INVALIDATING, CacheResetEvidence(False, True, True)),  # {"success": false}
        (S.INVALIDATING, CacheResetEvidence(True, True, False)),
        (S.VALIDATING, valid(actual=(5, 6, 8))),
        (S.VALIDATING, valid(label="g0")),
        (S.VALIDATING, valid(gen=Generation(number=2, label="g2"), label="g2")),
        (S.RESUMING, ResumeEvidence(200, True)),
        (S.RESUMING, ResumeEvidence(500, False)),
    ],
)
def test_evidence_that_does_not_prove_is_refused(state: ReplicaState, bad: object) -> None:
    lc = walk(state)
    assert lc.state is state
    with pytest.raises(PostconditionFailed):
        advance(lc, bad)  # type: ignore[arg-type]
    assert lc.state is state  # pure: the caller's value is unchanged


def test_label_unsupported_on_026_still_needs_probe() -> None:
    lc = walk(S.VALIDATING)
    ok = ValidationEvidence(G1, LabelEvidence(False, None), PROBE, PROBE)
    assert advance(lc, ok).state is S.RESUMING
    with pytest.raises(PostconditionFailed):
        advance(lc, ValidationEvidence(G1, LabelEvidence(False, None), (), ()))


def test_offered_checksums_must_prove_equality() -> None:
    """Pins #22: where the transfer offered checksums, a passing probe is not enough."""
    lc = walk(S.VALIDATING)
    ok = ValidationEvidence(G1, LabelEvidence(False, None), PROBE, PROBE)
    assert (
        advance(lc, dataclasses.replace(ok, checksums=ChecksumEvidence(compared=3))).state
        is S.RESUMING
    )
    for bad in (
        ChecksumEvidence(compared=3, mismatched=1, examples=("k_proj",)),
        ChecksumEvidence(compared=2, missing=1),
        ChecksumEvidence(compared=3, unexpected=1),
        ChecksumEvidence(compared=0),
        ChecksumEvidence(compared=0, error="no extension"),
    ):
        with pytest.raises(PostconditionFailed, match="checksums"):
            advance(lc, dataclasses.replace(ok, checksums=bad))


@pytest.mark.parametrize("state", list(S))
def test_ambiguous_failure_taints_from_every_state(state: ReplicaState) -> None:
    lc = Lifecycle(state=state, generation=G0)
    out = advance(lc, StepFailed("transfer", FailureKind.AMBIGUOUS, "timeout"))
    assert out.state is S.TAINTED and "timeout" in out.reason


@pytest.mark.parametrize("state", [s for s in S if s is not S.TAINTED])
def test_no_mutation_failure_stays(state: ReplicaState) -> None:
    lc = Lifecycle(state=state, generation=G0)
    with pytest.raises(PostconditionFailed):
        advance(lc, StepFailed("preflight", FailureKind.NO_MUTATION, "bad shape"))


def test_illegal_events_raise_and_table_is_complete() -> None:
    events = [e for e, _ in happy_path()] + [UpdateCancelled(None), RecoveryStarted()]
    for state in S:
        for ev in events:
            if type(ev) is StepFailed or type(ev) in TRANSITIONS[state]:
                continue
            with pytest.raises(IllegalTransition):
                advance(Lifecycle(state=state, generation=G0), ev)  # type: ignore[arg-type]
    assert set(TRANSITIONS) == set(S)


def test_tainted_recovers_only_through_fresh_bootstrap() -> None:
    lc = advance(walk(S.UPDATING), StepFailed("transfer", FailureKind.AMBIGUOUS, "hung"))
    with pytest.raises(IllegalTransition):
        advance(lc, ResumeEvidence(200, False))
    with pytest.raises(IllegalTransition):
        advance(lc, boot())
    lc = advance(lc, RecoveryStarted("restart"))
    assert lc.state is S.RECOVERING
    with pytest.raises(PostconditionFailed):
        advance(lc, BootstrapEvidence(G1, "id1", "0.32.0", completion_ok=False))
    bad = BootstrapEvidence(G1, "id1", "0.32.0", validation=valid(actual=(1,)), completion_ok=True)
    with pytest.raises(PostconditionFailed):
        advance(lc, bad)
    good = BootstrapEvidence(
        G1, "id1", "0.32.0", validation=valid(), completion_ok=True, process=P1, loaded=True
    )
    assert advance(lc, good).state is S.READY
    assert advance(lc, good).process == P1


@pytest.mark.parametrize(
    ("process", "loaded", "why"),
    [
        (P0, True, "no evidence of a new process"),  # the tainted process itself
        (None, True, "no evidence of a new process"),  # identity not reported: unprovable
        (P1, False, "not loaded from scratch"),  # a new process, trusted as started
    ],
)
def test_recovery_needs_a_new_process_and_weights_loaded_from_scratch(
    process: ProcessIdentity | None, loaded: bool, why: str
) -> None:
    """A replica tainted mid-transfer was published READY again
    on the same process with no reload. I6: recovery proves a new process and a fresh load."""
    lc = advance(walk(S.UPDATING), StepFailed("transfer", FailureKind.AMBIGUOUS, "hung"))
    assert lc.process == P0
    lc = advance(lc, RecoveryStarted("restart"))
    ev = BootstrapEvidence(
        G0,
        "id0",
        "0.32.0",
        validation=valid(G0, label="g0"),
        completion_ok=True,
        process=process,
        loaded=loaded,
    )
    with pytest.raises(PostconditionFailed, match=why):
        advance(lc, ev)


def test_cancel_returns_to_old_generation_only_after_resume() -> None:
    lc = walk(S.QUIESCED)
    with pytest.raises(PostconditionFailed):
        advance(lc, UpdateCancelled(ResumeEvidence(200, True)))
    out = advance(lc, UpdateCancelled(ResumeEvidence(200, False)))
    assert out.state is S.READY and out.generation == G0 and out.target is None


def test_drain_target_must_be_newer() -> None:
    lc = walk(S.READY)
    with pytest.raises(PostconditionFailed):
        advance(lc, DrainRequested(G0, "id0"))


@pytest.mark.parametrize(
    ("new", "replaces"),
    [
        (ProcessIdentity("e1", "a1"), True),  # both say: another process
        (ProcessIdentity("e1", None), False),  # the provider cannot say so any more
        (ProcessIdentity("e1", "a0"), False),  # the provider still runs the tainted one
        (ProcessIdentity("e0", "a1"), False),  # the engine still reports the tainted one
    ],
)
def test_a_new_process_needs_the_engine_and_the_provider_to_say_so(
    new: ProcessIdentity, replaces: bool
) -> None:
    """I6 with a replica provider: a tainted replica whose provider gave its process an
    identity (Ray actor, pod UID, pid + start time) recovers only when the engine *and* the
    provider both report another process."""
    tainted = ProcessIdentity("e0", "a0")
    assert new.replaces(tainted) is replaces
    lc = Lifecycle(S.RECOVERING, G0, "id0", process=tainted)
    ev = BootstrapEvidence(
        G0, "id0", "0.32.0", valid(G0, label="g0"), completion_ok=True, process=new, loaded=True
    )
    if replaces:
        assert advance(lc, ev).process == new
    else:
        with pytest.raises(PostconditionFailed, match="no evidence of a new process"):
            advance(lc, ev)


def test_process_identity_round_trips_through_its_stored_form() -> None:
    both = ProcessIdentity("api-server-started:12.34", "ray-actor:ab12")
    assert ProcessIdentity.decode(both.encode()) == both
    assert ProcessIdentity.decode("api-server-started:12.34") == ProcessIdentity(
        "api-server-started:12.34"
    )  # a record written before providers had identities
    assert ProcessIdentity.decode("") is None and ProcessIdentity.decode(None) is None
    # an engine-only identity is replaced by any other engine process
    assert ProcessIdentity("e1", "a1").replaces(ProcessIdentity("e0"))


def test_a_failed_probe_names_what_was_expected_and_what_came_back() -> None:
    """A taint reason that said only ``probe_matches=False`` could not tell stale weights from
    an aborted or empty probe (a flaky integration run could not be diagnosed from it)."""
    lc = walk(S.VALIDATING)
    with pytest.raises(PostconditionFailed, match=r"expected \[5, 6, 7\], got \[5, 9\]"):
        advance(lc, valid(actual=(5, 9)))


def test_nothing_is_evidence_against_an_unknown_process() -> None:
    """Audit finding: an unknown recorded identity counted as replaced, so I6 held only by the
    reload. Recovery now records the tainted process first (GONE where it no longer ran)."""
    assert not ProcessIdentity("e1", "a1").replaces(None)
    lc = Lifecycle(S.RECOVERING, G0, "id0", process=None)
    ev = BootstrapEvidence(
        G0,
        "id0",
        "0.32.0",
        valid(G0, label="g0"),
        completion_ok=True,
        process=ProcessIdentity("e1"),
        loaded=True,
    )
    with pytest.raises(PostconditionFailed, match="no evidence of a new process"):
        advance(lc, ev)
    gone = dataclasses.replace(lc, process=ProcessIdentity(GONE))
    assert advance(gone, ev).state is S.READY
