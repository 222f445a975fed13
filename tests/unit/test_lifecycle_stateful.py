"""Random interleavings of admit / release / drain / update steps / failures / recovery.

The machine drives the pure controller and the real Redis store together (the controller
decides, the store commits with a fencing token, exactly as the updater does) and checks the
invariants after every step:

* I1  an admission succeeds only on a READY replica serving the published generation
      (``max_staleness=0``), and no admission lands in the journal after a replica's DRAINING
      commit until it is READY again; a router's grant (capacity held in advance) grows only
      on such a replica and only out of free capacity (bindings and grants count together);
* I2  never QUIESCED/UPDATING/INVALIDATING/VALIDATING/RESUMING with active bindings or with
      slots a router holds (the drain's evidence counts both; a grant is returned, as a
      router does, when its replica is tainted);
* I3  never READY on a new generation without a proving cache reset and validation since the
      drain (or a validated fresh bootstrap after recovery);
* I4  an ambiguous failure never ends READY without a recovery;
* controller state == store state for every replica; a stale fencing token never writes;
* LoRA generations: a READY replica moves to g+1 on proving AdapterEvidence with no drain (not
  published until every replica that could moved), and the store's holds (what a retire must
  keep loaded) always cover the generation of every active binding and live grant on it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pool.errors import AdmissionRefused, LifecycleError, StaleFencingToken, StoreConflict
from pool.evidence import (
    AdapterEvidence,
    BootstrapEvidence,
    CacheResetEvidence,
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
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, GenerationRecord, ReplicaState, WeightIdentity
from testkit.redis_server import RedisServer
from tests.helpers import begin_drain

S = ReplicaState
REPLICAS = ("r0", "r1")
ROUTER = "router-m"
PROBE = (11, 12)
UPDATE_STATES = {S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING, S.RESUMING}


def ident(n: int) -> str:
    return WeightIdentity(manifest_digest="sha256:m", checkpoint_uri=f"/c/{n}", step=n).digest


class PoolMachine(RuleBasedStateMachine):
    rollouts = Bundle("rollouts")

    def __init__(self, where: str | StoreSettings) -> None:
        super().__init__()
        self.loop = asyncio.Runner()
        ns = uuid.uuid4().hex[:10]
        settings = (
            StoreSettings(url=where, namespace=ns)
            if isinstance(where, str)
            else where.model_copy(update={"namespace": ns})
        )
        self.store = RedisStore.connect(settings)
        self.lc: dict[str, Lifecycle] = {r: Lifecycle() for r in REPLICAS}
        self.active: dict[str, set[str]] = {r: set() for r in REPLICAS}
        self.proofs: dict[str, set[str]] = {r: set() for r in REPLICAS}
        self.ambiguous: dict[str, bool] = dict.fromkeys(REPLICAS, False)
        self.granted: dict[str, int] = dict.fromkeys(REPLICAS, 0)
        self.grant_gen: dict[str, int] = {}  # the generation each held grant was given on
        self.bound: dict[str, int] = {}  # rollout id -> its binding's generation
        self.latest = 0
        self.n = 0
        self.journal_state: dict[str, str] = dict.fromkeys(REPLICAS, "UNINITIALIZED")
        self.journal_seen = ""  # the last journal entry folded into journal_state

    def run(self, coro: Any) -> Any:
        return self.loop.run(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()

    def gen(self, n: int) -> Generation:
        return Generation(number=n, label=f"g{n}")

    def commit(self, rid: str, event: Event, **kw: Any) -> bool:
        """Controller decides; on success the store commits the same move (fenced CAS)."""
        before = self.lc[rid]
        try:
            after = advance(before, event)
        except LifecycleError:
            return False
        if after.state is S.READY and after.generation is not None:
            kw.setdefault("generation", after.generation)
            kw.setdefault("identity_digest", after.identity or "")
            kw.setdefault("publish", True)
            kw.setdefault("process", after.process and after.process.encode())
        if before.state is S.READY and after.state is S.DRAINING:
            assert after.target is not None
            kw.setdefault("target", after.target)
            kw.setdefault("target_identity", after.target_identity or "")
        self.run(self.store.transition(rid, self.token, before.state, after.state, **kw))
        self.lc[rid] = after
        if after.state is S.READY and after.generation is not None:
            self.latest = max(self.latest, after.generation.number)
        return True

    @initialize()
    def setup(self) -> None:
        self.lease = self.store.updater_lease("machine")
        self.token = self.run(self.lease.acquire())
        self.run(self.store.failover.heartbeat(ROUTER, 1, 3600))
        for rid in REPLICAS:
            self.run(self.store.register_replica(rid, f"http://{rid}", self.token, capacity=3))
            ev = BootstrapEvidence(
                self.gen(0), ident(0), "0.32.0", completion_ok=True, process=ProcessIdentity("p")
            )
            assert self.commit(rid, ev)

    # ------------------------------------------------------------------ data plane

    @rule(target=rollouts, rid=st.sampled_from(REPLICAS))
    def admit(self, rid: str) -> str:
        self.n += 1
        ro = f"ro{self.n}"
        lc = self.lc[rid]
        expect_ok = (
            lc.state is S.READY
            and lc.generation is not None
            and lc.generation.number == self.latest
            and len(self.active[rid]) + self.granted[rid] < 3
        )
        try:
            adm = self.run(self.store.admit(ro, rid))
        except AdmissionRefused:
            assert not expect_ok, f"refused an admissible rollout on {rid} ({lc})"
            return ""
        assert expect_ok, f"I1: admitted on {rid} in {lc.state} g{lc.generation}"
        assert adm.generation == self.latest
        self.active[rid].add(ro)
        self.bound[ro] = adm.generation
        return ro

    @rule(ro=consumes(rollouts))
    def release(self, ro: str) -> None:
        for rid, ids in self.active.items():
            if ro in ids:
                assert self.run(self.store.release(ro, rid))
                ids.discard(ro)

    @rule(rid=st.sampled_from(REPLICAS), slots=st.integers(1, 3))
    def grant(self, rid: str, slots: int) -> None:
        """A router sets its grant: shrinking always works, growing needs I1 and capacity."""
        lc, own = self.lc[rid], self.granted[rid]
        free = 3 - len(self.active[rid])
        admissible = (
            lc.state is S.READY
            and lc.generation is not None
            and lc.generation.number == self.latest
        )
        expect = slots if slots <= own else (min(slots, free) if admissible else own)
        try:
            g = self.run(self.store.grants.grant(ROUTER, rid, slots, max_staleness=0))
        except AdmissionRefused:
            assert expect <= own and slots > own, f"refused a grant on {rid} ({lc})"
            return
        assert g.slots == expect, f"I1: granted {g.slots} on {rid} in {lc.state}"
        if slots > own:
            assert admissible and g.generation == self.latest
        if own == 0:
            self.grant_gen[rid] = g.generation
        self.granted[rid] = g.slots

    @rule(rid=st.sampled_from(REPLICAS))
    def give_back(self, rid: str) -> None:
        self.run(self.store.grants.give_back(ROUTER, rid))
        self.granted[rid] = 0
        self.grant_gen.pop(rid, None)

    # ------------------------------------------------------------------ control plane

    @rule(rid=st.sampled_from(REPLICAS))
    def request_update(self, rid: str) -> None:
        n = self.latest + 1
        rec = GenerationRecord(
            generation=self.gen(n),
            identity=WeightIdentity(manifest_digest="sha256:m", checkpoint_uri=f"/c/{n}", step=n),
        )
        self.run(self.store.declare_generation(rec, self.token))
        if self.commit(rid, DrainRequested(self.gen(n), ident(n))):
            self.proofs[rid] = set()

    @rule(proven=st.booleans())
    def adapter_update(self, proven: bool) -> None:
        """A LoRA generation: every READY replica on the latest loads it beside, and moves to it
        on proving evidence (no drain; bindings on the old one go on); then it is published."""
        n = self.latest + 1
        g = self.gen(n)
        rec = GenerationRecord(  # as request_update declares it: either may come first
            generation=g,
            identity=WeightIdentity(manifest_digest="sha256:m", checkpoint_uri=f"/c/{n}", step=n),
        )
        self.run(self.store.declare_generation(rec, self.token))
        name = f"rp-{n}-{g.label}"
        ev = AdapterEvidence(g, ident(n), name, True, PROBE, PROBE if proven else (0,), name)
        moved = [
            rid
            for rid in REPLICAS
            if self.lc[rid].state is S.READY and self.commit(rid, ev, publish=False)
        ]
        assert proven or not moved, "AdapterEvidence that proves nothing moved a replica"
        self.latest = n - 1  # not published yet (commit() counted it)
        for rid in moved:
            assert self.active[rid] <= set(self.bound), "bindings survive the move"
        if moved:
            assert self.run(self.store.adapters.publish(g, ident(n), self.token))
            self.latest = n

    @rule(rid=st.sampled_from(REPLICAS), paused=st.booleans())
    def observe_drain(self, rid: str, paused: bool) -> None:
        rec = self.run(self.store.replica(rid))
        ev = DrainEvidence(rec.state is not S.READY, rec.busy, paused)
        assert rec.active == len(self.active[rid]) and rec.granted == self.granted[rid]
        self.commit(rid, ev)

    @rule(rid=st.sampled_from(REPLICAS), resumed=st.booleans())
    def cancel(self, rid: str, resumed: bool) -> None:
        self.commit(rid, UpdateCancelled(ResumeEvidence(200, not resumed)))

    @rule(rid=st.sampled_from(REPLICAS), right=st.booleans())
    def start_transfer(self, rid: str, right: bool) -> None:
        t = self.lc[rid].target_identity or ""
        self.commit(rid, TransferStarted(t if right else "bogus"))

    @rule(rid=st.sampled_from(REPLICAS), ok=st.booleans())
    def finish_transfer(self, rid: str, ok: bool) -> None:
        self.commit(rid, TransferEvidence("reload", self.lc[rid].target_identity or "", ok=ok))

    @rule(rid=st.sampled_from(REPLICAS), prefix=st.booleans())
    def reset_caches(self, rid: str, prefix: bool) -> None:
        if self.commit(rid, CacheResetEvidence(prefix, True, True)):
            self.proofs[rid].add("reset")

    @rule(rid=st.sampled_from(REPLICAS), match=st.booleans(), label_ok=st.booleans())
    def validate(self, rid: str, match: bool, label_ok: bool) -> None:
        target = self.lc[rid].target or self.gen(0)
        label = target.label if label_ok else "wrong"
        ev = ValidationEvidence(target, LabelEvidence(True, label), PROBE, PROBE if match else (0,))
        if self.commit(rid, ev):
            self.proofs[rid].add("validate")

    @rule(rid=st.sampled_from(REPLICAS), ok=st.booleans())
    def resume(self, rid: str, ok: bool) -> None:
        before = self.lc[rid]
        if self.commit(rid, ResumeEvidence(200, not ok)) and before.state is S.RESUMING:
            assert {"reset", "validate"} <= self.proofs[rid], "I3: READY without proofs"

    @rule(rid=st.sampled_from(REPLICAS), ambiguous=st.booleans())
    def fail(self, rid: str, ambiguous: bool) -> None:
        kind = FailureKind.AMBIGUOUS if ambiguous else FailureKind.NO_MUTATION
        if self.lc[rid].state is S.TAINTED and ambiguous:
            return
        before = self.lc[rid]
        if self.commit(rid, StepFailed("step", kind, "injected")):
            assert ambiguous and self.lc[rid].state is S.TAINTED
            self.ambiguous[rid] = True
            # the drain policy would abort what was left on a tainted replica
            if before.state in (S.READY, S.DRAINING):
                for ro in sorted(self.active[rid]):
                    self.run(self.store.release(ro, rid))
                self.active[rid].clear()
                self.give_back(rid)  # the routers cut what ran under their grants
        else:
            assert self.lc[rid] == before

    @rule(rid=st.sampled_from(REPLICAS), completion_ok=st.booleans(), fresh=st.booleans())
    def recover(self, rid: str, completion_ok: bool, fresh: bool) -> None:
        """I6: only a new process with the weights loaded from scratch leaves RECOVERING."""
        self.commit(rid, RecoveryStarted("restart"))
        recovering = self.lc[rid].state is S.RECOVERING
        tainted_process = self.lc[rid].process
        g = self.gen(self.latest)
        v = ValidationEvidence(g, LabelEvidence(True, g.label), PROBE, PROBE)
        ev = BootstrapEvidence(
            g,
            ident(self.latest),
            "0.32.0",
            v,
            completion_ok=completion_ok,
            process=ProcessIdentity(f"p{self.n}-{rid}") if fresh else tainted_process,
            loaded=fresh,
        )
        recovered = self.commit(rid, ev)
        if recovering:
            assert recovered == (completion_ok and fresh)
        if recovered:
            self.ambiguous[rid] = False
        self.n += 1

    @precondition(lambda self: self.n % 7 == 3)
    @rule()
    def rotate_lease(self) -> None:
        """A new updater takes over; the old token must never write again."""
        old = self.token
        self.run(self.lease.release())
        self.lease = self.store.updater_lease(f"u{self.n}")
        self.token = self.run(self.lease.acquire(blocking_timeout_s=2))
        assert self.token > old
        with pytest.raises(StaleFencingToken):
            self.run(self.store.transition("r0", old, self.lc["r0"].state, S.TAINTED))
        self.n += 1

    # ------------------------------------------------------------------ invariants

    async def observe(self) -> tuple[list[Any], dict[str, set[int] | None], list[Any]]:
        """One look at the store for every invariant: the replicas, what each must keep loaded,
        and the journal entries since the last look (concurrent reads, one loop run)."""
        start = f"({self.journal_seen}" if self.journal_seen else "-"
        recs, journal, *holds = await asyncio.gather(
            self.store.replicas(),
            self.store.journal(start=start),
            *(self.store.adapters.holds(rid) for rid in REPLICAS),
        )
        return recs, dict(zip(REPLICAS, holds, strict=True)), journal

    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "token"):
            return
        recs, holds, journal = self.run(self.observe())
        self.store_agrees_with_controller(recs)
        self.holds_cover_what_runs(holds)
        self.no_admission_while_closed(journal)

    def store_agrees_with_controller(self, recs: list[Any]) -> None:
        for rec in recs:
            lc = self.lc[rec.replica_id]
            assert rec.state is lc.state
            assert rec.active == len(self.active[rec.replica_id])
            assert rec.granted == self.granted[rec.replica_id]
            if rec.state is S.READY:
                assert lc.generation is not None and rec.generation == lc.generation.number
            if rec.state in UPDATE_STATES:
                assert rec.busy == 0, f"I2: {rec.replica_id} {rec.state} with active bindings"
            if self.ambiguous[rec.replica_id]:
                assert rec.state is not S.READY, "I4: READY after an ambiguous failure"

    def holds_cover_what_runs(self, holds: dict[str, set[int] | None]) -> None:
        """What may still run on a replica (a retire must keep its adapter loaded)."""
        for rid in REPLICAS:
            assert holds[rid] is not None
            running = {self.bound[ro] for ro in self.active[rid]}
            if self.granted[rid]:
                running.add(self.grant_gen[rid])
            assert holds[rid] == running, f"{rid}: holds {holds[rid]}, running {running}"

    def no_admission_while_closed(self, journal: list[Any]) -> None:
        """Folds the new journal entries into each replica's last committed state."""
        for e in journal:
            f = e.fields
            if e.type == "transition":
                self.journal_state[f["replica"]] = f["to"]
            elif e.type == "admit":
                where = self.journal_state[f["replica"]]
                assert where == "READY", f"admission in {where}"
            self.journal_seen = e.id


def test_pool_invariants_hold_under_random_interleavings(redis_server: RedisServer) -> None:
    run_state_machine_as_test(
        lambda: PoolMachine(redis_server.url),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_store_refuses_conflicting_write_from_a_lagging_controller(
    redis_server: RedisServer,
) -> None:
    """If two controllers disagree, the CAS — not luck — stops the second."""
    m = PoolMachine(redis_server.url)
    try:
        m.setup()
        token = m.token
        m.run(begin_drain(m.store, "r0", token, m.gen(1), ident(1)))
        with pytest.raises(StoreConflict):
            m.run(begin_drain(m.store, "r0", token, m.gen(1), ident(1)))
    finally:
        m.teardown()
