"""One replica, full update cycle, through the controller: real vLLM CPU + real Redis.

The replica starts on marker checkpoint M0 (greedy and sampled output is always token T0), so
the tokens of a rollout name the generation that produced them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from pool.engine import VllmEngine
from pool.errors import AdmissionRefused
from pool.evidence import TransferEvidence
from pool.types import BindingState, Generation, ReplicaState, WeightIdentity
from rolloutpool.local.models import ensure_model, marker_token
from testkit.loop_stalls import LoopStalls
from testkit.redis_server import RedisServer
from tests.integration.marker_pool import PROMPT, Pool, marker_dir, marker_pool, target
from updater.cycle import (
    CycleError,
    CycleRunner,
    Deadlines,
    DrainPolicy,
    Probe,
    UpdateTarget,
)
from updater.transports.base import WeightsTarget
from updater.transports.reload import ReloadTransport

pytestmark = pytest.mark.integration
S = ReplicaState


@pytest_asyncio.fixture(scope="module")
async def pool(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Pool]:
    work = tmp_path_factory.mktemp("cycle")
    async with marker_pool(redis_server.url, work, "cycle", ReloadTransport()) as p:
        yield p


async def serve(
    p: Pool, rollout: str, max_tokens: int, temperature: float = 1.0
) -> tuple[int, ...]:
    """One rollout through the store, the way a router does it: admit, generate, release."""
    adm = await p.store.admit(rollout, "r0")
    try:
        out = await p.handle.engine.complete(
            list(PROMPT),
            max_tokens=max_tokens,
            temperature=temperature,
            cache_salt=adm.label,
            timeout_s=120,
        )
    except BaseException:
        await p.store.release(rollout, "r0", BindingState.ABORTED, reason="error")
        raise
    await p.store.release(rollout, "r0", completion_tokens=len(out))
    return out


async def test_full_cycle_with_a_live_rollout(pool: Pool) -> None:
    p = pool
    assert (await p.store.replica("r0")).state is S.READY
    assert await serve(p, "warm", 4) == (marker_token(0),) * 4

    async def live() -> tuple[int, ...]:
        """Admitted before the drain; generates its 256 tokens only once the replica is
        DRAINING, so the drain must wait for the whole generation whatever the machine speed."""
        adm = await p.store.admit("live-256", "r0")
        while (await p.store.replica("r0")).state is S.READY:
            await asyncio.sleep(0.005)
        out = await p.handle.engine.complete(
            list(PROMPT), max_tokens=256, temperature=1.0, cache_salt=adm.label, timeout_s=120
        )
        await p.store.release("live-256", "r0", completion_tokens=len(out))
        return out

    live_task = asyncio.create_task(live())
    while (await p.store.replica("r0")).active == 0:
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    report = await p.runner.run(p.handle, target(1))
    took = time.monotonic() - t0
    tokens = await live_task

    assert report.outcome == "ready" and p.handle.lc.state is S.READY
    assert tokens == (marker_token(0),) * 256, "the live rollout must finish on g0 alone"
    assert report.window_s is not None and report.phases["drain"] > 0.05
    assert set(report.phases) >= {
        "preflight",
        "drain",
        "pause",
        "transfer",
        "invalidate",
        "validate",
        "resume",
    }
    rec = await p.store.replica("r0")
    assert (rec.state, rec.generation, rec.label) == (S.READY, 1, "g1")
    assert (await p.store.latest())[0] == Generation(number=1, label="g1")  # type: ignore[index]
    label = await p.handle.engine.weight_label()
    assert label.label == "g1"

    entries = await p.store.journal()

    def at(kind: str, key: str, value: str) -> int:
        return next(i for i, e in enumerate(entries) if e.type == kind and e.fields[key] == value)

    admit, release = at("admit", "rollout", "live-256"), at("release", "rollout", "live-256")
    draining, updating = at("transition", "to", "DRAINING"), at("transition", "to", "UPDATING")
    assert admit < draining < release < updating, "drain must wait for the live rollout"
    states = [e.fields["to"] for e in entries[draining:] if e.type == "transition"]
    assert states == [
        "DRAINING",
        "QUIESCED",
        "UPDATING",
        "INVALIDATING",
        "VALIDATING",
        "RESUMING",
        "READY",
    ]
    assert await serve(p, "after", 8) == (marker_token(1),) * 8
    print(f"cycle phases: {report.model_dump(mode='json')} total {took:.2f}s")


async def test_bad_checkpoint_is_refused_before_any_mutation(pool: Pool, tmp_path: Path) -> None:
    p = pool
    cur = p.handle.lc.generation
    assert cur is not None
    g = cur.number + 1
    wide = ensure_model("random", seed=1, intermediate_size=512)
    missing = target(g)
    bad = [
        UpdateTarget(missing.generation, missing.identity, tmp_path / "missing", missing.probe),
        target(g, path=wide),
        UpdateTarget(
            Generation(number=g, label=f"g{g}"),
            WeightIdentity(
                manifest_digest="sha256:other", checkpoint_uri=str(marker_dir(g)), step=g
            ),
            marker_dir(g),
            Probe(PROMPT, (1,)),
        ),
    ]
    for t in bad:
        with pytest.raises(CycleError) as e:
            await p.runner.run(p.handle, t)
        assert e.value.report.outcome == "refused", e.value.report
        rec = await p.store.replica("r0")
        assert rec.state is S.READY and rec.generation == cur.number
    assert await serve(p, f"still-{g}", 4) == (marker_token(cur.number),) * 4


class HangingTransport(ReloadTransport):
    """Fault injection (a real server cannot be made to hang on demand): the transfer blocks
    forever after the real preflight, like a collective whose peer died."""

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_stuck_transfer_taints_within_deadline_then_recovers(pool: Pool) -> None:
    p = pool
    cur = p.handle.lc.generation
    assert cur is not None
    g = cur.number + 1
    hang = CycleRunner(p.store, p.lease, HangingTransport(), deadlines=Deadlines(transfer_s=1.0))
    async with LoopStalls() as stalls:
        with pytest.raises(CycleError) as e:
            await hang.run(p.handle, target(g))
    report = e.value.report
    assert report.outcome == "tainted"
    # the transfer phase ends at its deadline, late only by this loop's measured stalls (the
    # cycle runs on it) plus 0.25 s for the few statements around the wait
    waited = report.phases["transfer"]
    assert 1.0 <= waited <= 1.0 + 0.25 + stalls.stalled_s, (waited, stalls.stalled_s)
    rec = await p.store.replica("r0")
    assert rec.state is S.TAINTED and "transfer" in rec.reason
    assert (await p.store.latest())[0].number == cur.number  # type: ignore[index]  # never published

    # recovery: a fresh process, the latest generation loaded from scratch, validated
    await p.runner.start_recovery(p.handle, "restart after stuck transfer")
    await p.replica.restart()
    latest = target(cur.number)
    report = await p.runner.bootstrap(
        p.handle, latest.generation, latest.identity, latest.probe, checkpoint=latest.path
    )
    assert report.outcome == "ready"
    rec = await p.store.replica("r0")
    assert (rec.state, rec.generation) == (S.READY, cur.number)
    assert await serve(p, "recovered", 4) == (marker_token(cur.number),) * 4


@pytest.mark.parametrize(
    ("policy", "waits_s", "why"),
    [(DrainPolicy.WAIT, 1.0, "policy=wait"), (DrainPolicy.ABORT, 0.0, "drain policy=abort")],
)
async def test_every_drain_ends_and_records_what_it_cut(
    pool: Pool, policy: DrainPolicy, waits_s: float, why: str
) -> None:
    """A session nobody closes (a heartbeating client) used to keep a ``wait`` drain open
    forever (``drain_timeout_s`` was ignored with ``wait``). Every drain ends:
    ``wait`` after ``drain_timeout_s``, ``abort`` at once; the binding is marked aborted with the
    reason in its provenance (never silently lost), and the update goes on."""
    p = pool
    cur = p.handle.lc.generation
    assert cur is not None
    g = cur.number + 1
    await p.store.admit(f"held-open-{policy}", "r0", session=True)
    runner = CycleRunner(
        p.store, p.lease, ReloadTransport(), drain_policy=policy, drain_timeout_s=1.0
    )
    t0 = time.monotonic()
    report = await runner.run(p.handle, target(g))
    assert report.outcome == "ready" and report.aborted_rollouts == [f"held-open-{policy}"]
    assert waits_s <= report.phases["drain"] < waits_s + 4 and time.monotonic() - t0 < 10
    b = await p.store.binding(f"held-open-{policy}")
    assert b.state is BindingState.ABORTED and why in b.reason
    assert await serve(p, f"after-abort-{g}", 4) == (marker_token(g),) * 4


async def test_failed_validation_taints_and_never_publishes(pool: Pool) -> None:
    p = pool
    cur = p.handle.lc.generation
    assert cur is not None
    g = cur.number + 1
    wrong = target(g, expected=g + 5)  # the probe expects another marker
    with pytest.raises(CycleError) as e:
        await p.runner.run(p.handle, wrong)
    assert e.value.report.outcome == "tainted" and "validate" in e.value.report.reason
    assert (await p.store.latest())[0].number == cur.number  # type: ignore[index]
    with pytest.raises(AdmissionRefused):
        await p.store.admit("nope", "r0")
