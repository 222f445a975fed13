"""The Ray provider for real: a 2-node Ray cluster on this machine, one vLLM CPU replica per
node, rolling updates under rollout load, an actor killed, a replica that fits no node
(:mod:`testkit.scenarios.ray_provider`). The full run, ``python -m bench.ray_provider``, also
loses a whole node (every process of node ``b`` SIGKILLed, its replica placed again on ``a``):
two more minutes of a replica restart that CI's budget leaves to the benchmark
(``bench/results/ray_provider.json``).

Needs the ``ray`` extra (scripts/test.sh installs it). Heavy: hold /work/heavy.lock.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from testkit.scenarios.ray_provider import Params, scenario

pytestmark = pytest.mark.integration


async def test_replicas_as_ray_actors_survive_an_actor_kill(
    tmp_path: Path,
) -> None:
    r = await scenario(Params(node_loss=False), tmp_path)
    print(r)
    assert r["placed_on"] == {"r0": "a", "r1": "b"}  # one replica per node, as preferred
    assert r["updates"] == 2
    assert r["cross_generation"] == 0, r["cross_generation_ids"]
    assert r["rollouts"] > 0 and r["leaked_bindings"] == 0
    assert r["min_admitting_replicas"] >= 1  # r0 served through the kill

    kill = r["actor_kill"]
    assert kill["recovered"], kill
    assert kill["new_actor"] != kill["old_actor"] and kill["restarts"] == 1
    assert kill["generation"] == 2  # the latest, loaded from scratch into the fresh process

    room = r["no_room"]
    assert room["refused"] and not room["actor_left"], room
    assert "no Ray node could host its actor" in room["reason"]
