"""Shorter runs of ``bench/reliability.py``: a replica SIGKILLed and one SIGSTOPped with
rollouts in flight, Redis restarted and stopped for 10 s under load (connecting as an ACL user
with a password), and bounded schemathesis fuzzing of the router and updater APIs."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.scenarios.reliability import scenario

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1500)
async def test_faults_outages_and_fuzzing(tmp_path: Path) -> None:
    r = await scenario(tmp_path, fuzz_examples=8)
    for fault in ("replica_crash", "replica_hang"):
        f = r[fault]
        assert f["detected_after_s"] is not None and f["detected_after_s"] < 10, f
        assert f["inflight_lost"] == 0, f["outcomes"]
        assert f["recovered"], f
    assert r["replica_crash"]["inflight_aborted"] >= 1
    o = r["redis_outage"]
    assert o["admitted_past_bound"] == 0, o  # under grants only while they cannot have lapsed
    assert o["stopped_10s"]["requests_during"] > 0
    assert o["stopped_10s"]["update_push_during"].startswith("refused")
    assert o["bindings_lost_after_restart"] == 0
    # a str message (pytest shortens a dict's repr): why the update after the outage ended so
    assert o["resumed"], (
        f"restart resumed={o['restart']['resumed']}, stopped_10s resumed="
        f"{o['stopped_10s']['resumed']}, update after: {o['update_after']} "
        f"{o['update_after_error']!r} {o['update_after_replicas']}"
    )
    z = r["fuzz"]
    assert z["server_errors"] == 0, f"updater:\n{z['updater_tail']}\nrouter:\n{z['router_tail']}"
    assert z["leaked_bindings"] == 0
    assert z["updater_cases"] and z["router_cases"]
