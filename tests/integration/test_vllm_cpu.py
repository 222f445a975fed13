"""The engine adapter, the launcher and the reload transport against ONE real vLLM CPU server.

The server (fixture ``replica_a``) serves tiny model A. Every test leaves it resumed, serving
A's weights, so tests are order-independent; each mutation test checks that A's reference
probe output comes back.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from pool.checkpoint import content_hash, read_manifest
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.launcher import LaunchError, LocalReplica, ReplicaSpec
from pool.procgroup import group_stats
from pool.types import Manifest, WeightIdentity
from tests.helpers import generate_tokens
from tests.integration.conftest import TinyModels
from updater.transports import ReloadTransport, WeightsTarget

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROBE = [0, *range(300, 316)]  # 17 prompt tokens
PROBE_LEN = 8
# 300 tokens: two full 128-token KV blocks can be served from the prefix cache.
LONG = [0, *[(i * 37) % 1700 + 300 for i in range(299)]]


def identity_of(path: Path, **overrides: object) -> WeightIdentity:
    fields: dict[str, object] = {
        "manifest_digest": read_manifest(path).digest,
        "checkpoint_uri": str(path),
        "content_hash": content_hash(path),
    }
    fields.update(overrides)
    return WeightIdentity.model_validate(fields)


@pytest.fixture(scope="module")
def manifest_a(tiny_models: TinyModels) -> Manifest:
    """The replica's manifest as recorded at bootstrap (from the checkpoint it started with)."""
    return read_manifest(tiny_models.a)


@pytest.fixture(scope="module")
async def probe_a(engine_a: VllmEngine) -> tuple[int, ...]:
    """A's reference greedy output, taken before any test mutated the server."""
    out = await engine_a.complete(PROBE, max_tokens=PROBE_LEN)
    assert out == await engine_a.complete(PROBE, max_tokens=PROBE_LEN)  # deterministic
    return out


async def reload_cycle(
    engine: VllmEngine, transport: ReloadTransport, target: WeightsTarget, label: str
) -> float:
    """pause(wait) -> preflight -> transfer -> reset caches -> label -> resume. Returns the
    transfer's elapsed seconds."""
    assert (await engine.pause("wait")).proves_paused
    try:
        await transport.preflight(engine, target)
        ev = await transport.transfer(engine, target)
        assert ev.ok and ev.transport == "reload" and ev.identity_digest == target.identity.digest
        assert ev.bytes > 3_000_000
        assert (await engine.reset_caches()).proves_reset
        assert (await engine.set_label(label)).label == label
    finally:
        assert (await engine.resume()).proves_resumed
    return ev.elapsed_s


async def test_engine_bootstrap_detects_032_capabilities(
    engine_a: VllmEngine, replica_a: LocalReplica, tiny_models: TinyModels
) -> None:
    caps = engine_a.capabilities
    assert caps.version.startswith("0.32") and caps.version_tuple[:2] == (0, 32)
    assert caps.labels and caps.spans_generate
    assert not caps.spans_completions and not caps.paused_503
    assert engine_a.model_id == str(tiny_models.a)
    assert await engine_a.health()
    assert (await engine_a.world_size()).world_size == 1
    assert replica_a.startup_s is not None and replica_a.pid is not None
    print(f"\n[measure] server start to first completion: {replica_a.startup_s:.1f}s")


def _thread_masks(pgid: int) -> dict[str, set[tuple[int, ...]]]:
    """Process name → the CPU masks of its threads, for each process of group ``pgid``."""
    masks: dict[str, set[tuple[int, ...]]] = {}
    for pid in group_stats(pgid):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        tasks = Path(f"/proc/{pid}/task").iterdir()
        masks[comm] = masks.get(comm, set()) | {
            tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in tasks
        }
    return masks


async def test_ready_replica_has_its_cpus_back_but_its_worker_stays_bound(
    replica_a: LocalReplica,
) -> None:
    """Started confined to ``cpu_bind`` ("0"); once ready, the API server and EngineCore threads
    have the launcher's CPUs again, while vLLM keeps its CPU worker bound to core 0."""
    assert replica_a.pid is not None
    masks = _thread_masks(replica_a.pid)
    mine = tuple(sorted(os.sched_getaffinity(0)))
    assert masks.pop("VLLM::Worker") == {(0,)}, masks
    assert masks.pop("VLLM::EngineCor") == {mine}, masks
    assert masks and all(m == {mine} for m in masks.values()), masks  # the API server et al.


async def test_pause_wait_queues_new_requests_until_resume(
    engine_a: VllmEngine, probe_a: tuple[int, ...]
) -> None:
    ev = await engine_a.pause("wait")
    try:
        assert ev.proves_paused and ev.mode == "wait"
        assert await engine_a.is_paused()
        # vLLM 0.32: a request sent to a paused engine is queued silently (no 503).
        pending = asyncio.create_task(engine_a.complete(PROBE, max_tokens=PROBE_LEN))
        await asyncio.sleep(1.0)
        assert not pending.done()
    finally:
        resumed = await engine_a.resume()
    assert resumed.proves_resumed and not await engine_a.is_paused()
    assert await asyncio.wait_for(pending, 30) == probe_a


async def test_reset_caches_proves_reset_and_drops_prefix_hits(engine_a: VllmEngine) -> None:
    await engine_a.complete(LONG, max_tokens=1)
    before = await engine_a.metrics()
    await engine_a.complete(LONG, max_tokens=1)
    warm = await engine_a.metrics()
    assert warm.prefix_cache_queries >= before.prefix_cache_queries + len(LONG)
    assert warm.prefix_cache_hits - before.prefix_cache_hits == 256  # two 128-token blocks

    ev = await engine_a.reset_caches()
    assert ev.proves_reset and ev.attempts == 1, ev

    await engine_a.complete(LONG, max_tokens=1)
    after = await engine_a.metrics()
    assert after.prefix_cache_hits == warm.prefix_cache_hits  # nothing left to hit
    assert after.requests_running == 0 and after.requests_waiting == 0


async def test_label_round_trip_and_token_spans(engine_a: VllmEngine) -> None:
    original = await engine_a.weight_label()
    assert original.supported and original.label
    try:
        set_ev = await engine_a.set_label("itest-g7")
        assert (set_ev.supported, set_ev.label) == (True, "itest-g7")
        assert (await engine_a.weight_label()).label == "itest-g7"
        out = await generate_tokens(
            engine_a.url, engine_a.model_id, PROBE, {"max_tokens": 4, "temperature": 0.0}
        )
        assert len(out["token_ids"]) == 4
        spans = [(s["version"], s["start"], s["end"]) for s in out["weight_versions"]]
        assert spans == [("itest-g7", 0, 4)]
    finally:
        await engine_a.set_label(original.label or "default")


async def test_worker_error_is_ambiguous_and_next_call_works(
    engine_a: VllmEngine, probe_a: tuple[int, ...]
) -> None:
    with pytest.raises(AmbiguousMutation) as err:
        await engine_a.collective_rpc("no_such_worker_method")
    assert err.value.context["status"] == 500
    assert "no_such_worker_method" in err.value.context["body"]
    # vLLM closes the connection after this 500; without keep-alive the next call is clean.
    assert not await engine_a.is_paused()
    assert await engine_a.complete(PROBE, max_tokens=PROBE_LEN) == probe_a


async def test_reload_marker_then_b_then_back_to_a(
    engine_a: VllmEngine,
    tiny_models: TinyModels,
    manifest_a: Manifest,
    probe_a: tuple[int, ...],
) -> None:
    transport = ReloadTransport()
    T = tiny_models.marker_token_id

    def target(path: Path) -> WeightsTarget:
        return WeightsTarget(identity_of(path), path, manifest_a)

    try:
        t_marker = await reload_cycle(engine_a, transport, target(tiny_models.marker), "marker")
        assert await engine_a.complete(PROBE, max_tokens=PROBE_LEN) == (T,) * PROBE_LEN
        sampled = await engine_a.complete(PROBE, max_tokens=64, temperature=1.0)
        assert sampled == (T,) * 64
        assert await engine_a.complete(LONG, max_tokens=4) == (T,) * 4

        t_b = await reload_cycle(engine_a, transport, target(tiny_models.b), "b")
        probe_b = await engine_a.complete(PROBE, max_tokens=PROBE_LEN)
        assert probe_b != probe_a and probe_b != (T,) * PROBE_LEN
    finally:
        t_a = await reload_cycle(engine_a, transport, target(tiny_models.a), "default")
    assert await engine_a.complete(PROBE, max_tokens=PROBE_LEN) == probe_a
    print(
        f"\n[measure] reload_weights RPC: marker {t_marker * 1000:.0f} ms, "
        f"B {t_b * 1000:.0f} ms, A {t_a * 1000:.0f} ms"
    )


@pytest.mark.parametrize(
    "case",
    ["missing", "relative", "wrong-shapes", "wrong-dtype", "identity-digest", "identity-uri"],
)
async def test_bad_checkpoints_refused_before_mutation(
    case: str,
    engine_a: VllmEngine,
    tiny_models: TinyModels,
    manifest_a: Manifest,
    probe_a: tuple[int, ...],
    tmp_path: Path,
) -> None:
    b = tiny_models.b
    targets = {
        "missing": WeightsTarget(identity_of(b), tmp_path / "gone", manifest_a),
        "relative": WeightsTarget(identity_of(b), Path("relative/ckpt"), manifest_a),
        "wrong-shapes": WeightsTarget(identity_of(tiny_models.wide), tiny_models.wide, manifest_a),
        "wrong-dtype": WeightsTarget(identity_of(tiny_models.bf16), tiny_models.bf16, manifest_a),
        "identity-digest": WeightsTarget(
            identity_of(b, manifest_digest="sha256:" + "0" * 64), b, manifest_a
        ),
        "identity-uri": WeightsTarget(identity_of(b, checkpoint_uri="/elsewhere"), b, manifest_a),
    }
    target = targets[case]
    transport = ReloadTransport()
    assert (await engine_a.pause("wait")).proves_paused
    try:
        with pytest.raises(PreflightFailed) as err:
            await transport.preflight(engine_a, target)
    finally:
        assert (await engine_a.resume()).proves_resumed
    message = str(err.value)
    expected_words = {
        "missing": "does not exist",
        "relative": "absolute",
        "wrong-shapes": "shape [512, 128] != expected [256, 128]",
        "wrong-dtype": "dtype bfloat16 != expected float32",
        "identity-digest": "identity mismatch",
        "identity-uri": "identity mismatch",
    }
    assert expected_words[case] in message, message
    # The server still serves A, and its next requests work (a failed reload would kill it).
    assert await engine_a.complete(PROBE, max_tokens=PROBE_LEN) == probe_a


async def test_transfer_refuses_an_unpaused_engine(
    engine_a: VllmEngine, tiny_models: TinyModels, manifest_a: Manifest, probe_a: tuple[int, ...]
) -> None:
    target = WeightsTarget(identity_of(tiny_models.b), tiny_models.b, manifest_a)
    with pytest.raises(NoMutation, match="not paused"):
        await ReloadTransport().transfer(engine_a, target)
    assert await engine_a.complete(PROBE, max_tokens=PROBE_LEN) == probe_a


async def test_launcher_bad_start_raises_with_log_tail(tmp_path: Path) -> None:
    spec = ReplicaSpec(
        model=tmp_path / "no-such-model", name="itest-bad", work_dir=tmp_path, startup_timeout_s=180
    )
    replica = LocalReplica(spec)
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        await replica.start()
    elapsed = time.monotonic() - t0
    assert elapsed < 180
    ctx = err.value.context
    assert ctx["exit_code"] not in (None, 0)
    assert ctx["log_tail"].strip() and "no-such-model" in ctx["log_tail"]
    assert "last lines" in str(err.value)
    assert not replica.alive
    await replica.stop()  # idempotent after a failed start
    print(f"\n[measure] bad start detected after {elapsed:.1f}s (exit code {ctx['exit_code']})")
