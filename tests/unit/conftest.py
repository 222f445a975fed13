"""Fixtures of the unit tests that talk to a vLLM server: the stand-in (:mod:`testkit.standin`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rolloutpool.local.models import ensure_model
from testkit.standin import ReplicaConfig, StandinFleet, StandinReplica


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[StandinReplica, str]]:
    """A stand-in vLLM 0.32 replica of the tiny random model (instant unless a test slows it:
    :func:`tests.helpers.taking`) and its URL."""
    async with StandinFleet() as fleet:
        replica = await fleet.add(ReplicaConfig(model=ensure_model("random", seed=1)))
        yield replica, replica.url
