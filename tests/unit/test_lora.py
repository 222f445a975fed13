"""LoRA generations without vLLM: the adapter preflight, the READY -> READY move, the store's
publish and holds (real Redis), the router's model rewrite and answer check, and the updater's
roll and retire against engines whose HTTP layer is ``httpx.MockTransport`` (they record every
call and hold adapters as vLLM does). The same on real vLLM CPU: tests/integration/test_lora.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.adapter_sums import NotComparable, expected_adapter_checksums
from pool.adapters import adapter_name, read_adapter, served_model
from pool.checkpoint import read_manifest
from pool.checksum import Checksum, tensor_checksums, to_json
from pool.engine import Capabilities, VllmEngine
from pool.errors import (
    IllegalTransition,
    NotFound,
    PostconditionFailed,
    PreflightFailed,
    StaleFencingToken,
)
from pool.evidence import AdapterEvidence, ProcessIdentity
from pool.lifecycle import Lifecycle, advance
from pool.records import ReplicaOutcome, UpdateRecord, UpdateState
from pool.store import RedisStore
from pool.types import Generation, GenerationRecord, ReplicaState, WeightIdentity
from rolloutpool.local.models import ensure_model
from router.provenance import check_response
from router.proxy import upstream_body
from router.upstream import ReplicaInfo
from testkit.scenarios.lora import admitting_at
from updater.config import ReplicaConfig
from updater.cycle import CycleRunner, ReplicaHandle
from updater.lora import LoraRollout
from updater.replicas import ManagedReplica
from updater.transports.reload import ReloadTransport

S = ReplicaState
G0, G1, G2, G3 = (Generation(number=n, label=f"g{n}") for n in range(4))
BASE = ensure_model("random", seed=1)
MANIFEST = read_manifest(BASE)
O_PROJ = "base_model.model.model.layers.{}.self_attn.o_proj.lora_{}.weight"


def write_adapter(path: Path, *, rank: int = 8, a_in: int = 128, **config: Any) -> Path:
    """A PEFT adapter directory for the tiny model's ``o_proj`` (128 x 128)."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in (0, 1):
        tensors[O_PROJ.format(layer, "A")] = np.zeros((rank, a_in), dtype=np.float32)
        tensors[O_PROJ.format(layer, "B")] = np.zeros((128, rank), dtype=np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["o_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return path


# ------------------------------------------------------------------ preflight


def test_an_adapter_that_fits_the_base_passes(tmp_path: Path) -> None:
    info = read_adapter(write_adapter(tmp_path / "a"), MANIFEST, max_rank=16)
    assert info.rank == 8 and info.modules == (
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    )
    assert info.manifest.digest.startswith("sha256:")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 32}, "rank 32 is above the replicas' max_lora_rank 16"),
        ({"a_in": 64}, "do not fit the base module [128, 128]"),
        ({"use_dora": True}, "use_dora is set"),
        ({"peft_type": "IA3"}, "only LORA is served"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": "8"}, "'r' must be a positive integer"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_with_the_reason(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    """vLLM 0.32 loads a narrower lora_A without complaint and serves garbage (observed on CPU):
    the preflight is what refuses it."""
    with pytest.raises(PreflightFailed, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_adapter(write_adapter(tmp_path / "a", **kwargs), MANIFEST, max_rank=16)


def test_files_that_are_not_an_adapter_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PreflightFailed, match=r"no adapter_config\.json"):
        read_adapter(tmp_path, MANIFEST, max_rank=16)
    full = write_adapter(tmp_path / "full")  # a full checkpoint's tensor under the adapter name
    save_file(
        {"model.norm.weight": np.ones(128, np.float32)}, str(full / "adapter_model.safetensors")
    )
    with pytest.raises(PreflightFailed, match="not a LoRA factor"):
        read_adapter(full, MANIFEST, max_rank=16)
    other = write_adapter(tmp_path / "unknown")
    save_file(
        {
            "base_model.model.model.layers.0.mlp.zz.lora_A.weight": np.zeros((8, 4), np.float32),
            "base_model.model.model.layers.0.mlp.zz.lora_B.weight": np.zeros((4, 8), np.float32),
        },
        str(other / "adapter_model.safetensors"),
    )
    with pytest.raises(PreflightFailed, match="is not a linear module of the base model"):
        read_adapter(other, MANIFEST, max_rank=16)


def test_adapter_names() -> None:
    assert adapter_name(G0) is None and served_model(G0, "/m") == "/m"
    assert adapter_name(Generation(number=7, label="step-700")) == "rp-7-step-700"


# ------------------------------------------------------------------ lifecycle


def evidence(gen: Generation, **kw: Any) -> AdapterEvidence:
    name = adapter_name(gen) or ""
    base: dict[str, Any] = {
        "generation": gen,
        "identity_digest": f"id{gen.number}",
        "adapter": name,
        "listed": True,
        "probe_expected": (5, 5),
        "probe_actual": (5, 5),
        "answered_model": name,
        "process": "p",
    }
    return AdapterEvidence(**{**base, **kw})


def test_a_validated_adapter_moves_ready_to_ready_on_the_newer_generation() -> None:
    lc = Lifecycle(S.READY, G1, "id1", process=ProcessIdentity("p"))
    after = advance(lc, evidence(G2))
    assert (after.state, after.generation, after.identity) == (S.READY, G2, "id2")
    assert after.process == lc.process


@pytest.mark.parametrize(
    ("ev", "why"),
    [
        (evidence(G1), "not newer"),
        (evidence(G2, probe_actual=(5, 6)), "probe"),
        (evidence(G2, answered_model="rp-1-g1"), "answered_model"),
        (evidence(G2, listed=False), "listed=False"),
        (evidence(G2, process="q"), "server process changed"),
    ],
)
def test_adapter_evidence_that_does_not_prove_it_is_refused(ev: AdapterEvidence, why: str) -> None:
    lc = Lifecycle(S.READY, G1, "id1", process=ProcessIdentity("p"))
    with pytest.raises(PostconditionFailed, match=why):
        advance(lc, ev)


def test_an_adapter_joins_only_a_ready_replica() -> None:
    with pytest.raises(IllegalTransition):
        advance(Lifecycle(S.DRAINING, G1, "id1"), evidence(G2))


# ------------------------------------------------------------------ store (real Redis)


async def test_publish_is_fenced_and_only_moves_forward(store: RedisStore) -> None:
    lease = store.updater_lease("test")
    token = await lease.acquire()
    assert await store.adapters.publish(G1, "id1", token)
    assert not await store.adapters.publish(G1, "id1", token)
    latest = await store.latest()
    assert latest is not None and latest[0] == G1
    with pytest.raises(StaleFencingToken):
        await store.adapters.publish(G2, "id2", token + 1)


async def test_holds_counts_bindings_and_live_grants_on_their_generation(
    store: RedisStore,
) -> None:
    """What may still run g on a replica: a binding on g, a live router's grant given on g. A
    replica moved on to g+1 hands out neither on g any more."""
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.register_replica("r0", "http://r0", token)
    await store.transition(
        "r0", token, S.UNINITIALIZED, S.READY, generation=G1, identity_digest="id1", publish=True
    )
    assert await store.adapters.holds("r0") == set()
    await store.admit("ro-1", "r0")
    await store.failover.heartbeat("router-a", 1, 30)
    grant = await store.grants.grant("router-a", "r0", 2, max_staleness=0)
    assert grant.generation == 1
    await store.transition(
        "r0", token, S.READY, S.READY, generation=G2, identity_digest="id2", publish=False
    )
    await store.admit("ro-2", "r0")  # binds the record's generation: g2
    assert await store.adapters.holds("r0") == {1, 2}
    await store.release("ro-1", "r0")
    assert await store.adapters.holds("r0") == {1, 2}  # the grant on g1 still runs
    await store.grants.give_back("router-a", "r0")
    assert await store.adapters.holds("r0") == {2}


# ------------------------------------------------------------------ router


def test_the_router_sends_the_bound_adapter_and_checks_the_answer_names_it() -> None:
    info = ReplicaInfo("/models/base", Capabilities.from_version("0.32.0"))
    body = {"model": "rolloutpool", "prompt": "x"}
    out = upstream_body(body, "/v1/completions", "g2", "rp-2-g2", info, False)
    assert out["model"] == "rp-2-g2" and out["cache_salt"] == "g2"
    assert check_response({"model": "rp-2-g2", "choices": []}, "g2", "rp-2-g2") is None
    verdict = check_response({"model": "rp-1-g1", "choices": []}, "g2", "rp-2-g2")
    assert verdict is not None and "'rp-1-g1'" in verdict and "'rp-2-g2'" in verdict
    assert check_response({"model": "other", "choices": []}, "g2") is None  # weights: unchecked


# ------------------------------------------------------------------ the updater's roll


class FakeLoraServer:
    """A vLLM 0.32 server with LoRA: holds adapters by name; each answers its marker."""

    def __init__(
        self,
        load_status: int = 200,
        listed_after_failure: bool = False,
        broken: bool = False,
        corrupt: bool = False,
    ) -> None:
        self.adapters: dict[str, str] = {}
        self.ids: dict[str, int] = {}  # vLLM's adapter ids, in load order
        self.corrupt = corrupt  # the worker extension reports a factor unlike the directory's
        self.calls: list[str] = []
        self.metrics_queries: list[str] = []
        self.load_status = load_status
        self.listed_after_failure = listed_after_failure
        self.broken = broken  # a failed load leaves the base answering something else
        self.failed = False
        #: set: the next unload waits for it (``unloading`` is set once that unload arrived)
        self.hold_unload: asyncio.Event | None = None
        self.unloading = asyncio.Event()
        self.engine = VllmEngine(
            "http://vllm.test", timeout=30.0, transport=httpx.MockTransport(self.serve)
        )

    def factors(self, path: str) -> dict[str, Checksum]:
        """What the worker extension reports for the adapter loaded from ``path``: its factors
        as loaded (float32), one of them changed when ``corrupt``."""
        sums = expected_adapter_checksums(Path(path), "float32")
        if self.corrupt:
            name, c = next(iter(sums.items()))
            sums[name] = replace(c, plain=c.plain + 1)
        return sums

    @staticmethod
    def marker(model: str) -> int:
        return 100 + int(model.split("-")[1]) if model.startswith("rp-") else 100

    async def serve(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/unload_lora_adapter" and self.hold_unload is not None:
            hold, self.hold_unload = self.hold_unload, None
            self.unloading.set()
            await hold.wait()
        return self.handle(request)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append(f"{path} {body.get('lora_name', '')}".strip())
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/v1/models":
            data = [{"id": "base", "parent": None}]
            data += [{"id": n, "parent": "base", "root": p} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"data": data})
        if path == "/v1/load_lora_adapter":
            if self.load_status != 200:
                self.failed = True
                if self.listed_after_failure:
                    self.adapters[body["lora_name"]] = body["lora_path"]
                return httpx.Response(self.load_status, json={"error": {"message": "no"}})
            self.adapters[body["lora_name"]] = body["lora_path"]
            self.ids[body["lora_name"]] = len(self.ids) + 1
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": "cannot be found"}})
            return httpx.Response(200, text="Success")
        if path == "/v1/completions":
            model = body["model"]
            if model != "base" and model not in self.adapters:
                return httpx.Response(404, json={"error": {"message": "no such model"}})
            ids = [self.marker(model) + int(self.broken and self.failed)] * body["max_tokens"]
            return httpx.Response(200, json={"model": model, "choices": [{"token_ids": ids}]})
        if path == "/collective_rpc" and body["method"] == "rolloutpool_lora_checksums":
            held = {str(self.ids[n]): to_json(self.factors(p)) for n, p in self.adapters.items()}
            return httpx.Response(200, json={"results": [{"adapters": held, "elapsed_s": 0.0}]})
        if path == "/metrics":
            self.metrics_queries.append(str(request.url.params))
            return httpx.Response(200, text="process_start_time_seconds 1.7e9\n")
        return httpx.Response(404, json={"error": path})


def gen_record(gen: Generation) -> GenerationRecord:
    marker = FakeLoraServer.marker(adapter_name(gen) or "base")
    return GenerationRecord(
        generation=gen,
        identity=WeightIdentity(manifest_digest="m", checkpoint_uri=f"/adapters/{gen.number}"),
        checkpoint=f"/adapters/{gen.number}",
        probe_prompt=(1, 2),
        probe_expected=(marker, marker),
        adapter=adapter_name(gen) or "",
    )


async def lora_pool(
    store: RedisStore, servers: dict[str, FakeLoraServer], *, checksums: bool = False
) -> tuple[LoraRollout, dict[str, ManagedReplica]]:
    lease = store.updater_lease("test")
    token = await lease.acquire()
    await store.declare_generation(gen_record(G0), token)
    runner = CycleRunner(store, lease, ReloadTransport())
    replicas = {}
    for rid, server in servers.items():
        await store.register_replica(rid, "http://vllm.test", token)
        await store.transition(
            rid,
            token,
            S.UNINITIALIZED,
            S.READY,
            generation=G0,
            identity_digest=gen_record(G0).identity.digest,
            publish=True,
        )
        await server.engine.bootstrap()
        handle = ReplicaHandle(
            rid, server.engine, MANIFEST, Lifecycle(S.READY, G0, gen_record(G0).identity.digest)
        )
        replicas[rid] = ManagedReplica(ReplicaConfig(id=rid, model=BASE, url="http://x"), handle)
    return LoraRollout(runner, replicas, max_staleness=0, checksums=checksums), replicas


async def roll(
    lora: LoraRollout, store: RedisStore, gen: Generation, checkpoint: Path | None = None
) -> UpdateRecord:
    rec = UpdateRecord(
        id=f"up-{gen.number}",
        state=UpdateState.RUNNING,
        generation=gen.number,
        label=gen.label,
        checkpoint="",
        identity_digest="",
        created_ms=0,
    )
    gen_rec = gen_record(gen)
    if checkpoint is not None:
        gen_rec = gen_rec.model_copy(update={"checkpoint": str(checkpoint)})
    await store.declare_generation(gen_rec, lora.runner.lease.require())
    await lora.roll(rec, gen_rec)
    return rec


async def test_a_roll_loads_beside_validates_admits_publishes_and_retires(
    store: RedisStore,
) -> None:
    servers = {"r0": FakeLoraServer(), "r1": FakeLoraServer()}
    lora, _ = await lora_pool(store, servers)
    rec = await roll(lora, store, G1)
    assert not rec.error and all(r.outcome == "ready" for r in rec.replicas.values())
    latest = await store.latest()
    assert latest is not None and latest[0] == G1
    assert {r.generation for r in await store.replicas()} == {1}
    await store.admit("ro-held", "r0")  # a rollout on g1 on r0
    rec = await roll(lora, store, G2)
    assert not rec.error
    # g1 stays where a rollout holds it, goes where nothing does
    assert set(servers["r0"].adapters) == {"rp-1-g1", "rp-2-g2"}
    assert set(servers["r1"].adapters) == {"rp-2-g2"}
    await store.release("ro-held", "r0")
    assert await lora.retire() == {"r0": ["rp-1-g1"], "r1": []}
    assert set(servers["r0"].adapters) == {"rp-2-g2"}
    # the order on each replica: listed, loaded, probed through the adapter, then admitted
    calls = servers["r1"].calls
    assert calls.index("/v1/load_lora_adapter rp-1-g1") < calls.index("/v1/completions")
    # the process check scrapes only the process's start time, not all of /metrics
    assert servers["r1"].metrics_queries
    assert set(servers["r1"].metrics_queries) == {"name%5B%5D=process_start_time_seconds"}


async def test_an_update_does_not_wait_for_an_unload_in_flight(store: RedisStore) -> None:
    servers = {"r0": FakeLoraServer()}
    lora, _ = await lora_pool(store, servers)
    await roll(lora, store, G1)
    await store.admit("ro-g1", "r0")  # a rollout on g1 keeps rp-1-g1 through the next roll
    await roll(lora, store, G2)
    assert set(servers["r0"].adapters) == {"rp-1-g1", "rp-2-g2"}
    await store.release("ro-g1", "r0")
    servers["r0"].hold_unload = release = asyncio.Event()
    retiring = asyncio.create_task(lora.retire())
    await servers["r0"].unloading.wait()  # the unload of rp-1-g1 is in flight, unanswered
    rec = await asyncio.wait_for(roll(lora, store, G3), 30)  # without waiting for it
    assert rec.replicas["r0"].outcome is ReplicaOutcome.READY
    assert (await store.replica("r0")).generation == 3 and not retiring.done()
    release.set()
    assert await retiring == {"r0": ["rp-1-g1"]}
    assert set(servers["r0"].adapters) == {"rp-3-g3"}


async def test_a_replica_already_on_the_generation_is_left_as_it_is(store: RedisStore) -> None:
    """A reconcile or roll chose the replica from a store read taken before a recovery's
    catch-up moved it to the generation: under the replica's lock nothing is loaded again
    (vLLM would answer 400, and the cleanup would unload the adapter it serves)."""
    servers = {"r0": FakeLoraServer()}
    lora, replicas = await lora_pool(store, servers)
    await roll(lora, store, G1)
    servers["r0"].calls.clear()
    out = await lora._load_on(replicas["r0"], gen_record(G1))
    assert out.report.outcome is ReplicaOutcome.READY and "already on g1" in out.report.reason
    assert servers["r0"].calls == [] and set(servers["r0"].adapters) == {"rp-1-g1"}
    assert (await store.replica("r0")).state is S.READY


async def test_the_bench_times_admitting_from_the_stores_journal(store: RedisStore) -> None:
    """``push_to_all_admitting_s`` ends at the store's time of the last write that made the
    generation admissible everywhere: in a LoRA update the publish, after every replica's move."""
    servers = {"r0": FakeLoraServer(), "r1": FakeLoraServer(load_status=500)}
    lora, _ = await lora_pool(store, servers)
    since = (await store.journal())[-1].id.split("-")[0]
    assert await admitting_at(store, 1, int(since), 2) is None  # nothing happened yet
    await roll(lora, store, G1)
    assert await admitting_at(store, 1, int(since), 2) is None  # r1 refused it: not everywhere
    servers["r1"].load_status = 200
    await lora.reconcile()  # r1 moves to g1 after the publish
    entries = [e for e in await store.journal(start=since) if e.fields.get("generation") == "1"]
    publish = next(e for e in entries if e.type == "publish")
    r1 = next(e for e in entries if e.fields.get("replica") == "r1" and e.type == "transition")
    assert int(r1.fields["ts"]) >= int(publish.fields["ts"])
    assert await admitting_at(store, 1, int(since), 2) == int(r1.fields["ts"])
    assert await admitting_at(store, 1, int(since), 1) is not None


async def test_a_refused_load_leaves_the_replica_serving_its_generation(
    store: RedisStore,
) -> None:
    servers = {"r0": FakeLoraServer(), "r1": FakeLoraServer(load_status=500)}
    lora, replicas = await lora_pool(store, servers)
    rec = await roll(lora, store, G1)
    assert rec.replicas["r0"].outcome is ReplicaOutcome.READY
    assert rec.replicas["r1"].outcome is ReplicaOutcome.REFUSED, rec.replicas["r1"]
    r1 = await store.replica("r1")
    assert (r1.state, r1.generation) == (S.READY, 0)  # g0 serves on; not admitting g1
    assert replicas["r1"].handle.lc.state is S.READY
    latest = await store.latest()
    assert latest is not None and latest[0] == G1  # r0 proved it


async def test_a_failed_load_vllm_lists_anyway_is_unloaded_and_refused(store: RedisStore) -> None:
    """vLLM answers 500 but lists the adapter: it is unloaded again, and with g0's probe still
    passing the replica stays READY on g0, not admitting g1; nothing is published."""
    servers = {"r0": FakeLoraServer(load_status=500, listed_after_failure=True)}
    lora, _ = await lora_pool(store, servers)
    rec = await roll(lora, store, G1)
    assert rec.replicas["r0"].outcome is ReplicaOutcome.REFUSED
    assert servers["r0"].adapters == {}
    assert "/v1/unload_lora_adapter rp-1-g1" in servers["r0"].calls
    assert rec.error is not None and "no replica admitted" in rec.error
    latest = await store.latest()
    assert latest is not None and latest[0] == G0


async def test_a_failed_load_after_which_the_replica_answers_otherwise_taints(
    store: RedisStore,
) -> None:
    servers = {"r0": FakeLoraServer(load_status=500, broken=True)}
    lora, _ = await lora_pool(store, servers)
    rec = await roll(lora, store, G1)
    assert rec.replicas["r0"].outcome is ReplicaOutcome.TAINTED
    assert "g0's own probe now fails" in rec.replicas["r0"].reason
    assert (await store.replica("r0")).state is S.TAINTED
    latest = await store.latest()
    assert latest is not None and latest[0] == G0


async def test_a_replica_left_behind_is_brought_up_to_the_published_generation(
    store: RedisStore,
) -> None:
    servers = {"r0": FakeLoraServer(), "r1": FakeLoraServer(load_status=500)}
    lora, _ = await lora_pool(store, servers)
    await roll(lora, store, G1)
    assert (await store.replica("r1")).generation == 0  # refused: left behind
    servers["r1"].load_status = 200  # whatever failed is gone
    await lora.reconcile()
    r1 = await store.replica("r1")
    assert (r1.state, r1.generation) == (S.READY, 1)
    assert set(servers["r1"].adapters) == {"rp-1-g1"}
    servers["r0"].calls.clear()
    await lora.reconcile()  # nothing left behind: no engine call
    assert servers["r0"].calls == []


async def test_the_base_generations_record_outlives_pruning(store: RedisStore) -> None:
    """A LoRA replica is recovered on g0's record (the base), however many generations came
    after: pruning keeps the newest ``generation_records_max`` records and g0's."""
    lease = store.updater_lease("test")
    token = await lease.acquire()
    keep = store.settings.generation_records_max
    for n in range(keep + 3):
        await store.declare_generation(gen_record(Generation(number=n, label=f"g{n}")), token)
    assert (await store.generation_record(0)).generation == G0
    with pytest.raises(NotFound):
        await store.generation_record(1)
    assert (await store.generation_record(keep + 2)).generation.number == keep + 2


async def test_an_adapter_whose_loaded_factors_differ_from_its_directory_is_refused(
    store: RedisStore, tmp_path: Path
) -> None:
    servers = {"r0": FakeLoraServer(), "r1": FakeLoraServer(corrupt=True)}
    lora, replicas = await lora_pool(store, servers, checksums=True)
    rec = await roll(lora, store, G1, write_adapter(tmp_path / "g1", lora_alpha=16))
    assert rec.replicas["r0"].outcome is ReplicaOutcome.READY, rec.replicas["r0"]
    refused = rec.replicas["r1"]
    assert refused.outcome is ReplicaOutcome.REFUSED and "checksums" in refused.reason, refused
    r1 = await store.replica("r1")
    assert (r1.state, r1.generation) == (S.READY, 0)  # g0 serves on; not admitting g1
    assert servers["r1"].adapters == {}  # the adapter that differs was unloaded
    # the evidence r0 was admitted on compared every factor of both layers
    assert "/collective_rpc" in servers["r0"].calls
    assert replicas["r0"].handle.lc.generation == G1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_expected_checksums_are_the_factors_as_vllm_holds_them(dtype: str, tmp_path: Path) -> None:
    """vLLM casts each factor to the served dtype and multiplies ``lora_B`` by ``lora_alpha / r``
    in place (``LoRALayerWeights.optimize``): the same torch operations give the same sums."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 128), dtype=np.float32)
    b = rng.standard_normal((128, 8), dtype=np.float32)
    path = tmp_path / "ad"
    path.mkdir()
    save_file(
        {O_PROJ.format(0, "A"): a, O_PROJ.format(0, "B"): b},
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 12}))
    held_b = torch.from_numpy(b).to(getattr(torch, dtype))
    held_b *= 12 / 8
    held = tensor_checksums(
        [
            (
                "model.layers.0.self_attn.o_proj.lora_A",
                torch.from_numpy(a).to(getattr(torch, dtype)),
            ),
            ("model.layers.0.self_attn.o_proj.lora_B", held_b),
        ]
    )
    assert expected_adapter_checksums(path, dtype) == held
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    assert expected_adapter_checksums(path, dtype) != held  # the scaling counts


def test_an_adapter_scaled_per_module_is_not_comparable(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "ad", alpha_pattern={"o_proj": 4})
    with pytest.raises(NotComparable, match="pattern"):
        expected_adapter_checksums(path, "float32")
