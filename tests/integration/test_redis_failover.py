"""Redis failing over under rollout load, on real processes: Sentinel (1 primary, 2 replicas,
3 sentinels), two vLLM CPU replicas, the router and the updater
(:mod:`testkit.scenarios.redis_failover`; the benchmark runs 5 failovers of each kind).

One failover of each kind (SIGKILL in steady state, while DRAINING, after an admission burst,
mid-transition; SIGSTOP + SIGCONT): no rollout spans a weight change, every rollout a client
saw is finished or aborted with a reason, fencing tokens never go back, the pool admits again
within 10 s of the promotion, updates go on, and a resumed old primary refuses pool writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.scenarios.redis_failover import Params, scenario

pytestmark = pytest.mark.integration


async def test_failovers_under_load_lose_no_contract(tmp_path: Path) -> None:
    # down-after 2 s: a primary starved of CPU by the two replicas must not fail over by itself
    r = await scenario(Params(per_kind=1, settle_s=2.0, down_after_ms=2000), tmp_path)
    assert r["failed_to_run"] == []
    assert r["failovers"] == 5
    assert r["cross_generation"] == 0, r["cross_generation_ids"]
    assert r["silently_lost"] == 0, r["silently_lost_ids"]
    assert r["fencing_monotonic"] is True
    assert r["max_admitting_after_promotion_s"] < 10
    assert r["updates_after_failover"] >= 1
    (stopped,) = [row for row in r["rows"] if row["kind"] == "sigstop"]
    assert stopped["old_primary_write"].startswith(("NOREPLICAS", "READONLY")), stopped
