"""The router's /dashboard rendered by headless Chromium (Debian's ``chromium``): the DOM must
show the replicas with state, generation and active rollouts, the recent updates with phase
timings, and per-generation counts; a screenshot is saved next to the test's files."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from pool.records import UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from pool.web import start_server
from router.app import create_app
from router.settings import RouterSettings

pytestmark = pytest.mark.integration
S = ReplicaState
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium(url: str, profile: Path, *extra: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed (scripts/test.sh installs Debian's chromium)"
    out = subprocess.run(
        [exe, *FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


async def test_dashboard_in_headless_chromium(
    store_settings: StoreSettings, tmp_path: Path
) -> None:
    store = RedisStore.connect(store_settings)
    token = await store.updater_lease().acquire()
    for rid in ("replica-0", "replica-1"):
        await store.register_replica(rid, f"http://{rid}", token, capacity=8)
        await store.transition(
            rid,
            token,
            S.UNINITIALIZED,
            S.READY,
            generation=Generation(number=3, label="step-300"),
            publish=True,
        )
    await store.admit("ro-1", "replica-0")
    await store.admit("ro-2", "replica-0")
    await store.taint("replica-1", "health check failed", source="test")
    rec = UpdateRecord(
        id="up-abc",
        state=UpdateState.SUCCEEDED,
        generation=3,
        label="step-300",
        checkpoint="/ckpt/300",
        identity_digest="wid:x",
        created_ms=1,
        replicas={
            "replica-0": {
                "replica": "replica-0",
                "generation": 3,
                "outcome": "ready",
                "window_s": 0.0812,
                "phases": {"drain": 0.5, "transfer": 0.031, "validate": 0.04},
            }
        },
    )
    await store.save_update(rec)

    runner, port = await start_server(create_app(RouterSettings(), store_settings))
    try:
        url = f"http://127.0.0.1:{port}/dashboard"
        dom = await asyncio.to_thread(chromium, url, tmp_path / "p1", "--dump-dom")
        shot = tmp_path / "dashboard.png"
        await asyncio.to_thread(
            chromium, url, tmp_path / "p2", f"--screenshot={shot}", "--window-size=1100,900"
        )
    finally:
        await runner.cleanup()
        await store.close()
    assert "3 (step-300)" in dom
    assert '<td class="READY">READY</td>' in dom and '<td class="TAINTED">TAINTED</td>' in dom
    assert "2 / 8" in dom and "health check failed" in dom
    assert "up-abc" in dom and "transfer 0.031" in dom and "0.081" in dom
    assert "<tr><td>3</td><td>2</td></tr>" in dom  # two rollouts admitted on generation 3
    assert shot.exists() and shot.stat().st_size > 5000
    print(f"dashboard screenshot: {shot}")
