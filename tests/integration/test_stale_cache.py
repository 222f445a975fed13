"""Stale-cache proof (bench/stale_cache.py) as a CI test: real vLLM CPU servers + real Redis.

Two servers with identical flags are started once for the module: X on checkpoint A and the
reference server R on checkpoint B. :func:`bench.stale_cache.run_scenario` runs once (module
fixture); the tests assert on its result:

* the unsafe path (``reload_weights`` with no pause and no cache reset) really serves stale
  prefix-cache blocks and wrong tokens: the check can fail;
* the pool path (:class:`~updater.cycle.CycleRunner`) serves no stale block, salted or not, and
  exactly B's reference output;
* every bad checkpoint is refused before any mutation and no engine is poisoned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from pool.launcher import LocalReplica
from testkit.redis_server import RedisServer
from testkit.scenarios.stale_cache import (
    Checkpoints,
    make_specs,
    run_scenario,
    start_servers,
    stop_servers,
)
from tests.integration.conftest import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BAD_CASES = {
    "missing_path",
    "wrong_shapes",
    "wrong_dtype",
    "identity_manifest_digest",
    "identity_checkpoint_uri",
    "identity_content_hash",
}


@pytest.fixture(scope="module")
def ckpts(tiny_models: TinyModels) -> Checkpoints:
    return Checkpoints(
        a=tiny_models.a, b=tiny_models.b, wide=tiny_models.wide, bf16=tiny_models.bf16
    )


@pytest_asyncio.fixture(scope="module")
async def servers(
    ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[LocalReplica, LocalReplica]]:
    x_spec, r_spec = make_specs(ckpts, tmp_path_factory.mktemp("stale-cache"))
    x, r = await start_servers(x_spec, r_spec)
    try:
        yield x, r
    finally:
        await stop_servers(x, r)
        assert not x.alive and not r.alive


@pytest_asyncio.fixture(scope="module")
async def result(
    servers: tuple[LocalReplica, LocalReplica],
    ckpts: Checkpoints,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    x, r = servers
    out = await run_scenario(
        x, r, ckpts, redis_server.url, scratch=tmp_path_factory.mktemp("stale-scratch")
    )
    print(
        f"stale-cache scenario: unsafe={out['unsafe']} pool={out['pool']} timings={out['timings']}"
    )
    return out


async def test_identical_flags_and_cacheable_prompt(result: dict[str, Any]) -> None:
    assert result["flags"]["block_size"] == 128
    assert result["prompt_tokens"]["long"] >= 2 * 128
    assert result["flags"]["spec"]["dtype"] == "float32"


async def test_unsafe_reload_serves_stale_cache(result: dict[str, Any]) -> None:
    u = result["unsafe"]
    assert u["fill_hits"] == 256  # the cache was really filled under A
    assert u["stale_hits"] == 256, u
    assert u["matches_reference"] is False, u
    assert u["short_matches_reference"] is True, "the weights were B: only the cache is stale"
    assert u["restored_hits"] == 0


async def test_pool_cycle_serves_no_stale_cache(result: dict[str, Any]) -> None:
    p = result["pool"]
    assert p["cycle_outcome"] == "ready" and p["salt"] == "g1" and p["engine_label"] == "g1"
    assert p["warm_hits"] == {"salted_g0": 256, "unsalted": 256}  # there was something to reuse
    assert p["stale_hits"] == 0 and p["stale_hits_unsalted"] == 0, p
    assert p["matches_reference"] is True and p["matches_reference_unsalted"] is True, p
    assert p["fresh_hits_after"] == 256 and p["fresh_repeat_matches_reference"] is True
    phases = result["timings"]["cycle"]["phases"]
    assert set(phases) >= {
        "preflight",
        "drain",
        "pause",
        "transfer",
        "invalidate",
        "validate",
        "resume",
    }


async def test_bad_checkpoints_refused_without_poisoning(result: dict[str, Any]) -> None:
    b = result["bad_checkpoints"]
    assert {d["case"] for d in b["details"]} == BAD_CASES
    for d in b["details"]:
        assert d["outcome"] == "refused" and d["transitions"] == 0, d
        assert d["engine_alive"] and d["output_matches"] and d["still_ready_on_old"], d
        assert d["reason"].startswith("preflight:"), d
    assert b["tried"] == b["refused"] == len(BAD_CASES)
    assert b["engines_poisoned"] == 0
    assert result["verdict"]["ok"] is True
