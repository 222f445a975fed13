"""The stand-in over HTTP, in this process: faults, dying and restarting, version-dependent
behaviour, many replicas in one fleet, the admin endpoint, the CLI, and the pool's own clients
(engine adapter, reload transport, probe) driving a stand-in.

Hang checks wait a short client timeout: a hung replica never answers, so they cannot flake.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pool.checkpoint import content_hash, read_manifest
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation
from pool.types import WeightIdentity
from rolloutpool.local.models import ensure_model, marker_token
from testkit.standin import Faults, ReplicaConfig, StandinFleet, TimeModel, expected_tokens
from tests.helpers import generate_tokens
from updater.transports import ReloadTransport, WeightsTarget

PROMPT = [0, *range(300, 316)]


@pytest.fixture(scope="module")
def model_a() -> Path:
    return ensure_model("random", seed=1)


@pytest.fixture(scope="module")
def model_b() -> Path:
    return ensure_model("random", seed=2)


@pytest.fixture
async def fleet() -> AsyncIterator[StandinFleet]:
    async with StandinFleet(admin_port=0) as f:
        yield f


def client(url: str, timeout: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0)
    )


async def generate(c: httpx.AsyncClient, n: int = 4, **extra: object) -> httpx.Response:
    sp = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
    return await c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sp,
                                                        **extra})  # fmt: skip


async def test_hang_and_hang_paths_and_slow_health(fleet: StandinFleet, model_a: Path) -> None:
    rep = await fleet.add(ReplicaConfig(model=model_a))
    async with client(rep.url, timeout=0.3) as c:
        rep.faults = Faults(hang_paths=frozenset({"/collective_rpc"}))
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/collective_rpc", json={"method": "reload_weights"})
        assert (await c.get("/is_paused")).status_code == 200  # other paths still answer
        rep.faults = Faults(hang=True)
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/health")
        rep.faults = Faults(slow_health_s=0.5)
    async with client(rep.url) as c:
        t0 = time.monotonic()
        assert (await c.get("/health")).status_code == 200
        assert time.monotonic() - t0 >= 0.5


async def test_hang_after_holds_a_path_only_once_its_trigger_was_answered(
    fleet: StandinFleet, model_a: Path
) -> None:
    """What the fault matrix holds RESUMING with: the ``is_paused`` after the label read-back."""
    rep = await fleet.add(ReplicaConfig(model=model_a))
    rep.faults = Faults(hang_after={"/is_paused": "/weight_info"})
    async with client(rep.url, timeout=0.3) as c:
        assert (await c.get("/is_paused")).status_code == 200  # not armed yet
        assert (await c.get("/weight_info")).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/is_paused")
    assert rep.armed == {"/is_paused"}
    rep.faults = Faults()  # lifted: nothing stays armed
    async with client(rep.url) as c:
        assert rep.armed == set() and (await c.get("/is_paused")).status_code == 200


async def test_die_resets_connections_and_restart_is_a_fresh_process(
    fleet: StandinFleet, model_a: Path, model_b: Path
) -> None:
    rep = await fleet.add(ReplicaConfig(model=model_a, time=TimeModel(request_tokens_per_s=50)))
    async with client(rep.url) as c:
        await c.post("/update_weight_version", json={"new_version": "g3"})
        pending = asyncio.create_task(generate(c, 400))
        while not rep.engine or not rep.engine.running:
            await asyncio.sleep(0.01)
        await rep.die()
        with pytest.raises(httpx.TransportError):  # reset, not answered
            await pending
        with pytest.raises(httpx.ConnectError):
            await c.get("/health")
        await rep.restart(model_b)
        assert (await c.get("/weight_info")).json() == {"weight_version": "default"}
        r = await generate(c, 4)
        assert r.json()["choices"][0]["token_ids"] == list(expected_tokens(model_b, PROMPT, 4))


async def test_stuck_transfer_blocks_engine_calls_but_not_health(
    fleet: StandinFleet, model_a: Path
) -> None:
    rep = await fleet.add(ReplicaConfig(model=model_a))
    rep.faults = Faults(stuck_transfer=True)
    async with client(rep.url, timeout=0.3) as c, client(rep.url, timeout=30) as patient:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_a)}}
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/collective_rpc", json=rpc)
        with pytest.raises(httpx.ReadTimeout):
            await c.get("/is_paused")  # waits for the engine's utility turn, like vLLM's
        # answered however busy the host is (a short timeout here made the test flaky)
        assert (await patient.get("/health")).status_code == 200
        assert (await patient.get("/metrics")).status_code == 200


async def test_failed_reload_poisons_until_a_good_one(fleet: StandinFleet, model_a: Path) -> None:
    rep = await fleet.add(ReplicaConfig(model=model_a))
    async with VllmEngine(rep.url, timeout=5) as engine:
        await engine.bootstrap()
        with pytest.raises(AmbiguousMutation):
            await engine.collective_rpc("reload_weights", {"weights_path": "/no/such/ckpt"})
        assert await engine.health()  # /health stays 200, as on vLLM
        await engine.collective_rpc("reload_weights", {"weights_path": str(model_a)})
        assert len(await engine.complete(PROMPT, 4)) == 4  # the good reload healed it
        rep.faults = Faults(fail_reload=True)
        with pytest.raises(AmbiguousMutation):
            await engine.collective_rpc("reload_weights", {"weights_path": str(model_a)})
    async with client(rep.url) as c:
        with pytest.raises(httpx.TransportError):
            await generate(c)  # the first request after it kills the replica
        for _ in range(100):
            if not rep.alive:
                break
            await asyncio.sleep(0.01)
        assert not rep.alive
        with pytest.raises(httpx.ConnectError):
            await c.get("/health")


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
async def test_version_dependent_behaviour(
    fleet: StandinFleet, model_a: Path, version: str
) -> None:
    rep = await fleet.add(ReplicaConfig(model=model_a, version=version))
    async with client(rep.url, timeout=1.0) as c:
        assert (await c.get("/version")).json() == {"version": version}
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        cmpl = await c.post("/v1/completions", json={**body, "return_weight_versions": True})
        gen = (await generate(c, 3)).json()["choices"][0]["weight_versions"]
        if version == "0.26.0":
            assert (await c.get("/weight_info")).status_code == 404
            assert gen is None and "weight_versions" not in cmpl.json()["choices"][0]
            return
        spans = [{"version": "default", "start": 0, "end": 3}]
        assert gen == spans and cmpl.json()["choices"][0]["weight_versions"] == spans
        await c.post("/pause", params={"mode": "wait"})
        refused = await c.post("/v1/completions", json=body)
        assert refused.status_code == 503  # 0.33 refuses requests while paused (abort/wait)
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        await c.post("/pause", params={"mode": "keep"})
        queued = asyncio.create_task(c.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)
        assert not queued.done()  # keep still queues
        await c.post("/resume")
        assert (await queued).status_code == 200


async def test_128_replicas_in_one_process(fleet: StandinFleet, model_a: Path) -> None:
    t0 = time.monotonic()
    reps = await fleet.add_many(ReplicaConfig(model=model_a) for _ in range(128))
    started = time.monotonic() - t0
    assert len({r.port for r in reps}) == 128

    async def probe(url: str) -> list[int]:
        async with client(url) as c:
            r = await generate(c, 4)
            ids: list[int] = r.json()["choices"][0]["token_ids"]
            return ids

    outs = await asyncio.gather(*(probe(r.url) for r in reps))
    assert outs == [list(expected_tokens(model_a, PROMPT, 4))] * 128
    print(f"\n[measure] 128 stand-in replicas started in {started:.2f}s")


async def test_admin_endpoint(fleet: StandinFleet, model_a: Path) -> None:
    reps = await fleet.add_many(ReplicaConfig(model=model_a) for _ in range(2))
    assert fleet.admin_url is not None
    async with client(fleet.admin_url) as admin:
        r = await admin.post("/replicas/all/faults", json={"slow_health_s": 0.25})
        assert [s["faults"]["slow_health_s"] for s in r.json()] == [0.25, 0.25]
        assert all(rep.faults.slow_health_s == 0.25 for rep in reps)
        r = await admin.post("/replicas/1/time", json={"request_tokens_per_s": 7})
        assert reps[1].time.request_tokens_per_s == 7 and reps[0].time.request_tokens_per_s is None
        bad = await admin.post("/replicas/0/faults", json={"slow_health_s": -1})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
        assert (await admin.post("/replicas/9/die")).status_code == 404
        r = await admin.post("/replicas/0/die")
        assert r.json()[0]["alive"] is False and not reps[0].alive
        r = await admin.post("/replicas/0/restart", json={})
        assert r.json()[0]["alive"] is True and reps[0].faults == Faults()
        statuses = (await admin.get("/replicas")).json()
        assert [s["url"] for s in statuses] == [rep.url for rep in reps]


async def test_reload_cycle_with_the_pool_clients_and_probe(
    fleet: StandinFleet, model_a: Path, model_b: Path
) -> None:
    """The updater's reload transport and the engine adapter drive a stand-in through the
    cycle's steps; the probe from :func:`expected_tokens` validates the new weights."""
    rep = await fleet.add(ReplicaConfig(model=model_a, time=TimeModel(transfer_s=0.05)))
    identity = WeightIdentity(
        manifest_digest=read_manifest(model_b).digest,
        checkpoint_uri=str(model_b),
        content_hash=content_hash(model_b),
    )
    target = WeightsTarget(identity, model_b, read_manifest(model_a))
    transport = ReloadTransport()
    async with VllmEngine(rep.url) as engine:
        await engine.bootstrap()
        assert (await engine.pause("wait", clear_cache=False)).proves_paused
        await transport.preflight(engine, target)
        ev = await transport.transfer(engine, target)
        assert ev.ok and ev.elapsed_s >= 0.05
        assert (await engine.reset_caches()).proves_reset
        assert (await engine.set_label("g1")).label == "g1"
        assert (await engine.resume()).proves_resumed
        probe = expected_tokens(model_b, PROMPT, 8)
        assert await engine.complete(PROMPT, 8, cache_salt="g1") == probe
        out = await generate_tokens(
            rep.url, engine.model_id, PROMPT, {"max_tokens": 8, "temperature": 0}
        )
        assert tuple(out["token_ids"]) == probe
        assert [s["version"] for s in out["weight_versions"]] == ["g1"]


def test_cli_serves_n_replicas_until_terminated(tmp_path: Path, model_a: Path) -> None:
    urls_file = tmp_path / "urls.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testkit.standin", "--count", "3", "--admin-port", "0",
         "--model", str(model_a), "--urls-file", str(urls_file)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().strip() for _ in range(3)]
        doc = json.loads(urls_file.read_text())
        assert doc["urls"] == urls and doc["admin"].startswith("http://")
        assert doc["model"] == str(model_a)
        for url in urls:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        marker = ensure_model("marker", token_id=marker_token(2))
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(marker)}}
        r = httpx.post(urls[0] + "/collective_rpc", json=rpc, timeout=5)
        assert r.json() == {"results": [None]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


async def test_a_restart_is_a_new_process_to_the_updater(
    fleet: StandinFleet, model_a: Path
) -> None:
    """Like vLLM, the stand-in exports ``process_start_time_seconds``: the engine client's
    process identity (what I6 and an updater's adoption check compare) changes with a restart
    and only then. Without it every stand-in looked like an unidentified process."""
    rep = await fleet.add(ReplicaConfig(model=model_a))
    engine = VllmEngine(rep.url, timeout=5)
    try:
        first = (await engine.metrics()).process
        assert first is not None and first == (await engine.metrics()).process
        await rep.restart()
        assert (await engine.metrics()).process not in (None, first)
    finally:
        await engine.aclose()


async def test_a_held_request_is_served_once_the_hang_is_lifted(
    fleet: StandinFleet, model_a: Path
) -> None:
    """A hang holds what it accepted, as a SIGSTOPped server does; lifted (SIGCONT), the held
    request is answered (the fault matrix holds a cycle in a phase this way)."""
    rep = await fleet.add(ReplicaConfig(model=model_a))
    rep.faults = Faults(hang_paths=frozenset({"/reset_prefix_cache"}))
    async with client(rep.url) as c:
        held = asyncio.create_task(c.post("/reset_prefix_cache"))
        await asyncio.sleep(0)  # let it reach the server
        while not held.done() and (await c.get("/v1/models")).status_code != 200:
            pass
        assert not held.done()
        rep.faults = Faults()
        assert (await asyncio.wait_for(held, 10)).status_code == 200
