"""Fixtures for tests against real vLLM CPU servers.

Models are built offline by :mod:`rolloutpool.local.models` and cached across sessions in the
checkout's ``.cache`` (or ``$ROLLOUTPOOL_CACHE``: :func:`pool.paths.default_cache_root`). Servers
are expensive (20-45 s to start on 2 cores), so a module gets at most one: :func:`replica_a` (module
scope) serves tiny model A in float32, eager mode, 64 MiB KV cache, bound to core 0, with
``--enable-scale-out`` for the token API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from pool.engine import VllmEngine
from pool.launcher import LocalReplica, ReplicaSpec
from pool.paths import default_cache_root
from rolloutpool.local.models import ensure_model, marker_token


@dataclass(frozen=True)
class TinyModels:
    """Checkpoint directories (absolute) of the tiny test models."""

    a: Path  # random, seed 1
    b: Path  # random, seed 2 (same manifest as a)
    marker: Path  # emits marker_token_id for any prompt (same manifest as a)
    marker_token_id: int
    wide: Path  # intermediate_size 512: different shapes
    bf16: Path  # seed 1 in bfloat16: different dtypes


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return default_cache_root()


@pytest.fixture(scope="session")
def tiny_models(model_cache: Path) -> TinyModels:
    token = marker_token(1)
    return TinyModels(
        a=ensure_model("random", model_cache, seed=1),
        b=ensure_model("random", model_cache, seed=2),
        marker=ensure_model("marker", model_cache, token_id=token),
        marker_token_id=token,
        wide=ensure_model("random", model_cache, seed=1, intermediate_size=512),
        bf16=ensure_model("random", model_cache, seed=1, dtype="bfloat16"),
    )


@pytest_asyncio.fixture(scope="module")
async def replica_a(
    tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalReplica]:
    spec = ReplicaSpec(
        model=tiny_models.a,
        name="itest-a",
        cpu_bind="0",
        enable_scale_out=True,
        work_dir=tmp_path_factory.mktemp("replica-a"),
    )
    replica = LocalReplica(spec)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()
        assert not replica.alive


@pytest_asyncio.fixture(scope="module")
async def engine_a(replica_a: LocalReplica) -> AsyncIterator[VllmEngine]:
    engine = VllmEngine(replica_a.url, timeout=60.0)
    await engine.bootstrap()
    try:
        yield engine
    finally:
        await engine.aclose()
