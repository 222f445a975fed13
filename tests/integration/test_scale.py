"""The pool at small scale on real processes (``bench/scale.py`` is the big version):
real ``redis-server``, two ``python -m router`` processes, ``python -m updater`` driving 16
stand-in replicas (one ``python -m testkit.standin`` process) with ``max_unavailable`` 4 and
``min_serving`` 12, three updates rolled under closed-loop load of single requests and
sessions. Pins: no rollout mixes generations (every token is its bound generation's marker),
no binding is left active or leased, admitting capacity never drops below (N-k)/N during a roll
(the plan's ``min_serving`` across two routers and one updater), every replica ends on the last
generation, and every update succeeds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from testkit.scenarios.scale import Params, scenario

pytestmark = pytest.mark.integration


def test_sixteen_standins_two_routers_waves_of_four(tmp_path: Path) -> None:
    p = Params(
        replicas=16, routers=2, k=4, updates=3, concurrency=12,
        idle_s=1.0, steady_s=3.0, monitor_s=1.0, memory_sessions=32,
    )  # fmt: skip
    row = asyncio.run(scenario(p, tmp_path))
    assert row["updates_succeeded"] == 3, row["per_update"]
    assert row["rollouts_single"] > 100 and row["rollouts_session"] > 10, row["failures"]
    assert row["cross_generation"] == 0, row["cross_generation_ids"]
    assert row["leaked_bindings"] == 0
    assert row["all_on_last_generation"], row["last_generation"]
    # sampled during every roll: never fewer than N - k replicas admitting
    assert all(u["samples"] > 0 for u in row["per_update"])
    assert row["admitting_min"] >= (16 - 4) / 16, row["per_update"]
    assert row["failures"] == {}, row["failures"]
