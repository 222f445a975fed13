"""The pool's own control plane failing, with real processes: updater processes SIGKILLed,
SIGSTOPped past their lease and raced by a second one, SIGCONTed and SIGTERMed, by pid; real
redis-server, a router process, real vLLM CPU replicas of marker checkpoints, clients checking
every token against its generation's marker (:func:`testkit.fault_cells.real_sample`). The
fixed sample of the fault matrix that CI runs; ``bench/faults.py`` runs every cell.

Before the fixes this pins: a restarted updater re-registered its replica at the new URL with
the record still READY (routers admitted to an unvalidated server); a fenced-out updater's
taints fell back to unfenced writes, and its SIGTERM tainted the new holder's replicas; the
crashed updater's replicas lived on as orphans; its running update stayed ``running``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.fault_cells import real_sample

pytestmark = pytest.mark.integration


async def test_updater_crash_stop_and_takeover_keep_the_contract(tmp_path: Path) -> None:
    v = await real_sample(tmp_path / "rig")
    c = v["checks"]
    assert c["first_update"] == "succeeded", v
    assert c["after_kill"] == {"new_url": True, "generation": 1}, v
    assert c["update_after_kill_mid_update"] == "succeeded", v
    assert c["after_stale_sigterm"]["state"] == "READY", v
    assert c["update_after_takeover"] == "succeeded", v
    assert v["answers"] > 0, v
    assert v["cross_generation"] == 0, v
    assert v["unvalidated_ready"] == [], v
    assert v["stale_token_writes"] == [], v
    assert v["records_left_running"] == [], v
    assert v["leaked_bindings"] == 0, v
    assert v["orphaned_processes"] == [], v
