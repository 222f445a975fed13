"""What the updater refuses at submit (nothing queued), with a real Redis store; no vLLM is
contacted by a submit. Pins what an audit found (labels, probe ids, placeholders)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Collection
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import PreflightFailed, StoreConflict
from pool.evidence import TransferEvidence
from pool.records import ReplicaOutcome, ReplicaReport, UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, GenerationRecord, ReplicaState, WeightIdentity
from rolloutpool.local.models import VOCAB_SIZE, ensure_model
from router.settings import RouterSettings
from updater.api import ProbeSpec, UpdateRequest
from updater.cycle import Probe, UpdateTarget
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings
from updater.transports.base import Transport, WeightsTarget

S = ReplicaState


def updater(store: RedisStore) -> Updater:
    model = ensure_model("random", seed=1)
    settings = UpdaterSettings(replicas=[ReplicaConfig(id="r0", url="http://r0.test", model=model)])
    return Updater(settings, store)


def request(label: str | None = None, probe: tuple[int, ...] = (5, 6)) -> UpdateRequest:
    model = ensure_model("random", seed=2)
    return UpdateRequest(
        checkpoint=str(model),
        label=label,
        probe=ProbeSpec(prompt_token_ids=list(probe), expected_token_ids=[7]),
    )


async def declare(store: RedisStore, number: int, label: str) -> None:
    model = ensure_model("random", seed=1)
    lease = store.updater_lease("declare")
    token = await lease.acquire()
    ident = WeightIdentity(manifest_digest=read_manifest(model).digest, checkpoint_uri=str(model))
    rec = GenerationRecord(generation=Generation(number=number, label=label), identity=ident)
    try:
        await store.declare_generation(rec, token)
    finally:
        await lease.release()


async def test_a_label_names_one_generation_in_the_store(store: RedisStore) -> None:
    """Audit finding: duplicate generation labels were accepted, which weakens the span check
    and cache_salt (both key on the label). The DECLARE script refuses a taken label."""
    await declare(store, 1, "step-100")
    with pytest.raises(StoreConflict, match="already names generation 1"):
        await declare(store, 2, "step-100")
    assert await store.label_owner("step-100") == 1


async def test_submit_refuses_a_taken_label_and_picks_a_free_default(store: RedisStore) -> None:
    up = updater(store)
    await declare(store, 1, "g3")  # a user named generation 1 "g3"
    with pytest.raises(StoreConflict, match="labels must be unique"):
        await up.submit(request(label="g3"))
    first = await up.submit(request(label="mine"))
    with pytest.raises(StoreConflict, match="already names generation"):
        await up.submit(request(label="mine"))  # queued, not declared yet
    assert first.generation == 2
    second = await up.submit(request())
    assert (second.generation, second.label) == (3, "g3.1")


async def test_submit_refuses_probe_ids_outside_the_vocabulary(store: RedisStore) -> None:
    """Audit finding: probe token ids were not validated at submit (the update then failed on a
    replica, or worse, a probe of garbage ids 'passed')."""
    up = updater(store)
    with pytest.raises(PreflightFailed, match="outside the model's vocabulary"):
        await up.submit(request(probe=(5, VOCAB_SIZE)))
    with pytest.raises(ValidationError):
        request(probe=(-1, 5))
    assert await store.updates() == []


@pytest.mark.parametrize("secret", ["CHANGE-ME-updater-admin-token", "<your token>", "changeme"])
def test_placeholder_secrets_are_refused(secret: str) -> None:
    """Audit finding: the templates' CHANGE-ME tokens were accepted at runtime."""
    model = ensure_model("random", seed=1)
    replicas = [ReplicaConfig(id="r0", url="http://r0.test", model=model)]
    with pytest.raises(ValidationError, match="placeholder"):
        UpdaterSettings(replicas=replicas, admin_token=secret)
    with pytest.raises(ValidationError, match="placeholder"):
        RouterSettings(admin_token=secret)
    with pytest.raises(ValidationError, match="placeholder"):
        RouterSettings(api_keys=["a-real-key-123", secret])
    with pytest.raises(ValidationError, match="placeholder"):
        StoreSettings(password=secret)
    assert RouterSettings(admin_token="9f2c1e7a-real").admin_token is not None


class WaveRecorder(Transport):
    """Records the waves the updater announces; never asked to transfer here."""

    name = "recorder"

    def __init__(self) -> None:
        self.waves: list[list[str]] = []

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        raise AssertionError("not called: the cycles are stood in for")

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        raise AssertionError("not called: the cycles are stood in for")

    def expect_wave(self, urls: Collection[str]) -> None:
        self.waves.append(sorted(urls))


class Rolled(NamedTuple):
    rec: UpdateRecord
    waves: list[list[str]]  # what the transport was told of
    together: list[set[str]]  # the cycles running as each one started
    started: list[str]  # the cycles in the order they started
    before_publish: list[str]  # those started while g1 was not published
    stored: UpdateRecord  # the record in the store once the update ended


async def roll(
    store: RedisStore,
    n: int,
    failing: Collection[str] = (),
    recovers: Collection[str] = (),
    late: bool = False,
    **plan: int,
) -> Rolled:
    """One update of ``n`` replicas on generation 0 to generation 1 with the rolling settings
    ``plan``. The cycles are stood in for by their store transitions (the rolling plan reads
    only the store): each cycle of a replica in ``failing`` ends TAINTED in VALIDATING, the
    others READY on g1 (the first publishes it). A replica in ``recovers`` fails its first
    cycle the same way and is then recovered READY on g0, as a recovery that read the latest
    generation before the publish would leave it; no cycle publishes g1 before that, and its
    later cycles succeed. With ``late``, that recovery instead stays RECOVERING until g1 is
    published, then ends READY on g0 (it read the latest generation just before the publish)."""
    model = ensure_model("random", seed=1)
    ids = [f"r{i}" for i in range(n)]
    settings = UpdaterSettings(
        replicas=[ReplicaConfig(id=i, url=f"http://{i}.test", model=model) for i in ids],
        min_serving=0,
        **plan,
    )
    recorder = WaveRecorder()
    up = Updater(settings, store, transport=recorder)
    token = await up.lease.acquire()
    g0, g1 = Generation(number=0, label="g0"), Generation(number=1, label="g1")
    for i in ids:
        await store.register_replica(i, f"http://{i}.test", token)
        await store.transition(i, token, S.UNINITIALIZED, S.READY, generation=g0, publish=True)
    together: list[set[str]] = []
    started: list[str] = []
    before_publish: list[str] = []
    running: set[str] = set()
    recovered = asyncio.Event()
    if not recovers or late:
        recovered.set()
    recoveries: list[asyncio.Task[None]] = []

    async def recover_after_the_publish(replica_id: str) -> None:
        while (latest := await store.latest()) is None or latest[0].number < 1:
            await asyncio.sleep(0.01)
        await store.transition(replica_id, token, S.RECOVERING, S.READY, generation=g0)

    async def cycle(m: Any, target: UpdateTarget, rec: UpdateRecord) -> ReplicaReport:
        first = m.id not in started
        started.append(m.id)
        running.add(m.id)
        together.append(set(running))
        latest = await store.latest()
        if latest is None or latest[0].number < 1:
            before_publish.append(m.id)
        await asyncio.sleep(0.05)
        path = [S.READY, S.DRAINING, S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING]
        for a, b in itertools.pairwise(path):
            await store.transition(m.id, token, a, b, target=g1 if b is S.DRAINING else None)
        running.discard(m.id)
        if m.id in failing or (m.id in recovers and first):
            await store.transition(m.id, token, S.VALIDATING, S.TAINTED, reason="probe")
            if m.id in recovers:
                await store.transition(m.id, token, S.TAINTED, S.RECOVERING)
                if late:
                    recoveries.append(asyncio.create_task(recover_after_the_publish(m.id)))
                else:
                    await store.transition(m.id, token, S.RECOVERING, S.READY, generation=g0)
                    recovered.set()
            return ReplicaReport(
                replica=m.id, generation=1, outcome=ReplicaOutcome.TAINTED, reason="probe"
            )
        await recovered.wait()
        await store.transition(m.id, token, S.VALIDATING, S.RESUMING)
        await store.transition(
            m.id, token, S.RESUMING, S.READY, generation=g1, identity_digest="i1", publish=True
        )
        return ReplicaReport(replica=m.id, generation=1, outcome=ReplicaOutcome.READY)

    up._cycle = cycle  # type: ignore[method-assign]
    ident = WeightIdentity(manifest_digest=read_manifest(model).digest, checkpoint_uri="/g1")
    rec = UpdateRecord(
        id="up-1",
        state=UpdateState.QUEUED,
        generation=1,
        label="g1",
        checkpoint="/g1",
        identity_digest=ident.digest,
        created_ms=0,
    )
    await up.records.save(rec)
    await up._roll(rec, UpdateTarget(g1, ident, model, Probe((1,), (2,))))
    if rec.published_ms is None:  # nothing to recover across
        for t in recoveries:
            t.cancel()
    await asyncio.gather(*recoveries, return_exceptions=True)
    await up.lease.release()
    stored = await store.update(rec.id)
    return Rolled(rec, recorder.waves, together, started, before_publish, stored)


async def test_each_batch_of_several_replicas_is_announced_as_one_wave(store: RedisStore) -> None:
    """Pins that the updater tells the transport which replicas it updates at once (what lets
    ``nccl_direct`` send them one broadcast), and that the first replica of an update goes alone
    (nothing is published until it proved the generation): with 3 replicas and
    ``max_unavailable=2``, r0 alone, then r1 and r2 as one wave."""
    rec, waves, together, _, _, _ = await roll(store, 3, max_unavailable=2)
    assert rec.state is UpdateState.SUCCEEDED
    assert waves == [["http://r1.test", "http://r2.test"]]
    assert together[0] == {"r0"} and {"r1", "r2"} in together  # r1 and r2 ran at once


async def test_a_first_wave_updates_before_the_publish_and_its_first_ready_publishes(
    store: RedisStore,
) -> None:
    """``first_wave`` 3 of 3: every replica drains and updates at once, as one wave, before the
    generation is published; the update succeeds."""
    rec, waves, together, _, _, _ = await roll(store, 3, max_unavailable=3, first_wave=3)
    assert rec.state is UpdateState.SUCCEEDED and rec.published_ms is not None
    assert waves == [["http://r0.test", "http://r1.test", "http://r2.test"]]
    assert {"r0", "r1", "r2"} in together
    assert {r.state for r in await store.replicas()} == {S.READY}


async def test_a_failure_in_the_first_wave_stops_no_other_member_but_starts_no_new_one(
    store: RedisStore,
) -> None:
    """r0 of a first wave of 2 (of 4) fails validation; r1 publishes the generation, so the
    update goes on (r0 was replica-specific) and rolls r2 and r3; r0 is left to recovery."""
    rec, _, together, _, _, _ = await roll(
        store, 4, failing={"r0"}, max_unavailable=2, first_wave=2
    )
    assert rec.state is UpdateState.SUCCEEDED, rec.error
    assert together[0] == {"r0"} and {"r0", "r1"} in together
    assert rec.replicas["r0"].outcome is ReplicaOutcome.TAINTED
    assert {r: rec.replicas[r].outcome for r in ("r1", "r2", "r3")} == dict.fromkeys(
        ("r1", "r2", "r3"), ReplicaOutcome.READY
    )


async def test_a_first_wave_that_all_fails_fails_the_update_and_publishes_nothing(
    store: RedisStore,
) -> None:
    """Both members of a first wave of 2 (of 3) fail: the update fails once both are back,
    the generation is never published, and r2 is never tried."""
    rec, _, together, _, _, stored = await roll(
        store, 3, failing={"r0", "r1"}, max_unavailable=2, first_wave=2
    )
    assert rec.state is UpdateState.FAILED and rec.published_ms is None
    assert stored.state is UpdateState.FAILED and stored.error == rec.error  # readers see it
    assert rec.error.startswith("r0: ") or rec.error.startswith("r1: ")
    assert all("r2" not in t for t in together)
    latest = await store.latest()
    assert latest is not None and latest[0].number == 0


async def test_a_wave_member_recovered_on_the_old_generation_is_tried_again_after_the_publish(
    store: RedisStore,
) -> None:
    """Found by the fault matrix (first wave of 2, r0's process killed in UPDATING): r0 was
    recovered on g0 before r1 published g1, and the roll had already tried it, so it ended with
    "no replica left to update" and r0 stayed READY on g0, out of a strict pool's admissions
    until the next push. Now it is tried once more after the publish."""
    rec, _, _, started, _, _ = await roll(
        store, 2, recovers={"r0"}, max_unavailable=2, first_wave=2
    )
    assert rec.state is UpdateState.SUCCEEDED, rec.error
    assert started.count("r0") == 2 and started.count("r1") == 1
    assert {(r.state, r.generation) for r in await store.replicas()} == {(S.READY, 1)}


async def test_the_roll_waits_for_a_wave_member_recovering_across_the_publish(
    store: RedisStore,
) -> None:
    """Found by the fault matrix (first wave of 2, r0's server restarted in VALIDATING): r0's
    recovery read the latest generation (g0) just before r1 published g1 and ended READY on g0
    after it; the roll, which counts a RECOVERING replica as done, had already ended. Now it
    waits for that recovery and then tries r0 again."""
    rec, _, _, started, _, _ = await roll(
        store, 2, recovers={"r0"}, late=True, max_unavailable=2, first_wave=2
    )
    assert rec.state is UpdateState.SUCCEEDED, rec.error
    assert started.count("r0") == 2
    assert {(r.state, r.generation) for r in await store.replicas()} == {(S.READY, 1)}


async def test_a_failed_update_is_failed_in_the_store_too(store: RedisStore) -> None:
    """The first replica (``first_wave`` 1) fails: the update's end is saved, not only its
    last report; a reader of the stored record (``GET /v1/updates/{id}`` once the update left
    memory, a trainer polling it) sees it FAILED, never ``running`` for ever."""
    rec, _, _, started, _, stored = await roll(store, 2, failing={"r0"})
    assert rec.state is UpdateState.FAILED and started == ["r0"]
    assert stored.state is UpdateState.FAILED and stored.error == rec.error
    assert stored.finished_ms is not None


@settings(
    max_examples=15,
    deadline=None,
    # each example connects to its own namespace: the fixture's Redis is shared on purpose
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    n=st.integers(1, 5),
    wave=st.integers(1, 5),
    extra=st.integers(0, 4),
    failing=st.sets(st.sampled_from([f"r{i}" for i in range(5)])),
    recovers=st.sets(st.sampled_from([f"r{i}" for i in range(5)])),
    late=st.booleans(),
)
def test_any_first_wave_keeps_the_plan_and_ends_by_its_failures(
    store_settings: StoreSettings,
    n: int,
    wave: int,
    extra: int,
    failing: set[str],
    recovers: set[str],
    late: bool,
) -> None:
    """For any pool size, first wave, ``max_unavailable``, set of replicas whose cycles fail
    and set of first-wave members that fail once and are recovered on g0 (before or across the
    publish): at most ``first_wave`` cycles start before the generation is published; each
    replica is tried once, except that a recovered member is tried a second time, after the
    publish, when the update goes on; the update succeeds exactly when a replica of the first
    wave proved the generation, and then every replica is tried and every one not failing ends
    READY on it; when the whole first wave fails, no other replica is tried and nothing is
    published."""
    first_wave = min(wave, n)
    failing = {r for r in failing if int(r[1:]) < n}
    recovers = {r for r in recovers if int(r[1:]) < first_wave} - failing

    async def body() -> None:
        ns = f"t{uuid.uuid4().hex[:12]}"
        store = RedisStore.connect(store_settings.model_copy(update={"namespace": ns}))
        try:
            rec, _, _, tried, early, _ = await roll(
                store,
                n,
                failing,
                recovers,
                late,
                max_unavailable=min(n, first_wave + extra),
                first_wave=first_wave,
            )
            latest = await store.latest()
            ended = {r.replica_id: (r.state, r.generation) for r in await store.replicas()}
        finally:
            await store.close()
        assert len(early) <= first_wave and len(set(early)) == len(early)
        proved = [r for r in early if r not in failing | recovers]
        if proved:
            assert rec.state is UpdateState.SUCCEEDED, rec.error
            assert sorted(tried) == sorted([f"r{i}" for i in range(n)] + sorted(recovers))
            assert all(ended[r] == (S.READY, 1) for r in ended if r not in failing)
        else:
            assert rec.state is UpdateState.FAILED and rec.published_ms is None
            assert sorted(tried) == sorted(early) and latest is not None
            assert latest[0].number == 0

    asyncio.run(body())


def test_a_first_wave_larger_than_max_unavailable_is_refused() -> None:
    model = ensure_model("random", seed=1)
    with pytest.raises(ValidationError, match="first_wave 2 exceeds max_unavailable 1"):
        UpdaterSettings(
            replicas=[ReplicaConfig(id="r0", url="http://r0", model=model)], first_wave=2
        )


async def test_a_lost_transition_gets_the_replica_tainted_and_recovered(store: RedisStore) -> None:
    """A failover lost the RESUMING -> READY commit: the controller says READY, the store says
    RESUMING, no cycle runs. Before, nothing noticed (the replica stayed out of service, or a
    later cycle acted on a state the store never had); the supervisor now taints it (and, for
    a replica it cannot restart, waits for a new process)."""
    from pool.lifecycle import Lifecycle
    from pool.types import ReplicaState as S

    up = updater(store)
    token = await up.lease.acquire()
    await store.register_replica("r0", "http://r0.test", token)
    g0 = Generation(number=0, label="g0")
    await store.transition("r0", token, S.UNINITIALIZED, S.RESUMING, generation=g0)
    m = up.replicas["r0"]
    m.handle.lc = Lifecycle(S.READY, g0, "i", process="p")
    await up.supervisor.check(m, await store.replica("r0"))
    rec = await store.replica("r0")
    assert rec.state is S.TAINTED and "a state change was lost" in rec.reason
    assert m.handle.lc.state is S.TAINTED and m.quarantined
    await up.stop(stop_replicas=False)


async def test_stopping_the_updater_ends_the_cycles_it_started(store: RedisStore) -> None:
    """Found by the fault matrix (updater SIGTERMed with r0 held QUIESCED while a successor
    started): stop() cancelled the update worker but not the cycle tasks it had started, so a
    cycle ran on after its updater had stopped (through the epoch gate's timeout, a cancel,
    a taint it could no longer write) and the process did not exit for over 120 s. Here the
    stand-in (conformance-tested against vLLM) is held QUIESCED by a router registration that
    has not verified the failover epoch (the epoch gate waits for every live router)."""
    from rolloutpool.local.models import marker_token
    from testkit.standin import ReplicaConfig as StandinConfig
    from testkit.standin import StandinFleet

    base, new = (
        ensure_model("marker", token_id=marker_token(0)),
        ensure_model("marker", token_id=marker_token(1)),
    )
    async with StandinFleet(admin_port=0) as fleet:
        rep = await fleet.add(StandinConfig(model=base, served_model_name="rolloutpool"))
        settings = UpdaterSettings(replicas=[ReplicaConfig(id="r0", url=rep.url, model=base)])
        up = Updater(settings, store)
        await up.start()
        epoch = await store.failover.epoch()
        await store.failover.heartbeat("lagging-router", epoch.number - 1, 60.0)
        await up.submit(
            UpdateRequest(
                checkpoint=str(new),
                probe=ProbeSpec(
                    prompt_token_ids=list(range(10, 26)), expected_token_ids=[marker_token(1)] * 4
                ),
            )
        )
        # held QUIESCED by the lagging router for the gate's timeout (30 s); a cycle that missed
        # a deadline on the way (a starved host) ends TAINTED instead: say so, never wait on
        ended = (S.QUIESCED, S.TAINTED, S.RECOVERING)
        while (state := (await store.replica("r0")).state) not in ended:
            await asyncio.sleep(0.01)
        assert state is S.QUIESCED, f"r0 reached {state}, not QUIESCED"
        await up.stop(stop_replicas=False)
        cycles = [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") == "Updater._cycle"
        ]
        assert cycles == []
