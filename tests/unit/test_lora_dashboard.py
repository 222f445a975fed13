"""What ``/dashboard/data`` and the provenance record show of a LoRA pool's adapters
(:func:`router.dashboard.pool_view`, :func:`router.sessions.provenance`), on real Redis. The
page rendering them in a browser: tests/integration/test_dashboard.py."""

from __future__ import annotations

from pool.store import RedisStore
from pool.types import (
    Binding,
    BindingState,
    Generation,
    GenerationRecord,
    ReplicaState,
    WeightIdentity,
)
from router.dashboard import pool_view
from router.sessions import provenance

S = ReplicaState
G = [Generation(number=n, label=f"g{n}") for n in range(3)]


def record(g: Generation) -> GenerationRecord:
    return GenerationRecord(
        generation=g,
        identity=WeightIdentity(manifest_digest="m", checkpoint_uri=f"/a/{g.number}"),
        checkpoint=f"/a/{g.number}",
        adapter=f"rp-{g.number}-{g.label}" if g.number else "",
    )


async def ready_on(store: RedisStore, token: int, rid: str, g: Generation, frm: S) -> None:
    await store.transition(
        rid, token, frm, S.READY, generation=g, identity_digest="wid", publish=True
    )


async def test_each_replica_shows_its_adapter_and_those_still_running_on_it(
    store: RedisStore,
) -> None:
    token = await store.updater_lease("test").acquire()
    for g in G:
        await store.declare_generation(record(g), token)
    for rid in ("r0", "r1"):
        await store.register_replica(rid, "http://vllm.test", token)
        await ready_on(store, token, rid, G[0], S.UNINITIALIZED)
    await store.admit("ro-base", "r0")  # a rollout on the base, g0, on r0
    await ready_on(store, token, "r0", G[1], S.READY)
    await store.admit("ro-g1", "r0")  # on g1
    await ready_on(store, token, "r0", G[2], S.READY)
    await ready_on(store, token, "r1", G[2], S.READY)
    view = await pool_view(store, 0, lora=True)
    rows = {r["id"]: r for r in view["replicas"]}
    assert rows["r0"]["adapter"] == "rp-2-g2"
    assert rows["r0"]["adapters"] == ["base", "rp-1-g1", "rp-2-g2"]
    assert (rows["r1"]["adapter"], rows["r1"]["adapters"]) == ("rp-2-g2", ["rp-2-g2"])
    await store.release("ro-g1", "r0")
    await store.release("ro-base", "r0")
    rows = {r["id"]: r for r in (await pool_view(store, 0, lora=True))["replicas"]}
    assert rows["r0"]["adapters"] == ["rp-2-g2"]  # nothing runs on the older ones any more
    # a full-weight pool's rows have no adapter fields
    assert "adapters" not in (await pool_view(store, 0, lora=False))["replicas"][0]


def test_the_provenance_record_names_the_adapter_in_a_lora_pool() -> None:
    b = Binding(
        rollout_id="ro-1",
        replica_id="r0",
        generation=3,
        label="step-30",
        identity_digest="wid",
        state=BindingState.FINISHED,
        created_ms=1,
    )
    assert provenance(b, lora=True)["adapter"] == "rp-3-step-30"
    base = b.model_copy(update={"generation": 0, "label": "g0"})
    assert provenance(base, lora=True)["adapter"] is None
    assert "adapter" not in provenance(b, lora=False)
