"""LoRA generations on 2 real vLLM CPU replicas (``testkit.scenarios.lora``): 10 adapter pushes
under continuous rollouts through the router, no drain; a replica killed and recovered; the
prefix-cache control."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.scenarios.lora import Params, scenario

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
async def test_adapter_generations_side_by_side_never_mix(tmp_path: Path) -> None:
    r = await scenario(Params(updates=10, steady_s=5.0), tmp_path)
    assert r["updates"] == 10, r["updates_failed"]
    # with lora_checksums (every other push), every admitted adapter's factors, read in the
    # workers, equal its directory's
    checked = [push for push, on in zip(r["update_phases"], r["checksums_each"], strict=True) if on]
    assert len(checked) == 5 and all("checksums" in ph for push in checked for ph in push.values())
    assert r["rollouts"] > 50 and r["rollouts_by_kind"]["session"] > 0
    assert len(r["generations_seen"]) >= 8, r["generations_seen"]
    assert r["cross_generation"] == 0, r["cross_generation_ids"]
    # every replica admitting throughout: no drain, g+1 admissible beside g until published
    assert r["min_admitting_replicas"] == r["replicas"] == 2 and r["admitting_samples"] > 100
    control = r["prefix_control"]
    assert control["g"]["hits"] == 0 and control["g+1"]["hits"] == 0  # nothing from g's blocks
    assert control["g+1 again"]["hits"] > 0 and control["g again"]["hits"] > 0  # own blocks hit
    assert r["stale_prefix_hits_across_adapters"] == 0
    # a replica killed comes back in a new process on the base plus the latest adapter (I6)
    restart = r["restart"]
    assert restart["recovered"], restart
    assert list(restart["served"]) == [f"rp-{restart['generation']}-g{restart['generation']}"]
    # the session's generation was retired once it closed: one adapter left per replica
    assert all(len(held) == 1 for held in r["served_at_end"].values()), r["served_at_end"]
    assert r["client_errors"] == {}
