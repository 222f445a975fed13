"""The router's /dashboard rendered by headless Chromium (Debian's ``chromium``): the DOM must
show the replicas with state, generation and active rollouts, the recent updates with phase
timings, and per-generation counts; at 64 stand-in replicas, the grid and the live charts; a
screenshot is saved next to the test's files."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pool.records import UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from pool.web import start_server
from router.app import create_app
from router.settings import RouterSettings
from testkit.chromium import HEADLESS, Browser
from testkit.scenarios.scale import Load, Params, push, start_stack, worker

pytestmark = pytest.mark.integration
S = ReplicaState


def chromium(url: str, profile: Path, *extra: str) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed (scripts/test.sh installs Debian's chromium)"
    out = subprocess.run(
        [exe, *HEADLESS, f"--user-data-dir={profile}", *extra, url],
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


DOM = """JSON.stringify({
  cells: document.querySelectorAll('#grid .cell').length,
  states: [...document.querySelectorAll('#grid .cell')]
    .map((c) => c.dataset.state + ':' + c.textContent),
  timeline: Number(document.getElementById('timeline').dataset.samples) || 0,
  rates: Number(document.getElementById('rates').dataset.samples) || 0,
  updates: document.getElementById('update-summary').rows.length - 1,
  text: document.body.innerText})"""


async def drawn(b: Browser, done: Callable[[dict[str, Any]], bool]) -> str:
    """The page's state (JSON) once ``done`` holds for it, read every 0.1 s (60 s at most)."""
    async with asyncio.timeout(60):
        while not done(json.loads(dom := await b.evaluate(DOM))):
            await asyncio.sleep(0.1)
    return dom


async def test_dashboard_at_64_standin_replicas(tmp_path: Path) -> None:
    """The dashboard of a 64-replica pool (stand-ins, real Redis, updater and router
    processes), open in headless Chromium while two updates roll in waves of 8 under load:
    64 grid cells all READY on the last generation at the end, the timeline and the rates
    chart drawn from the page's own polls, both updates in the summary with their roll times.
    A screenshot is saved (``ROLLOUTPOOL_DASHBOARD_SHOT`` names a copy to keep)."""
    p = Params(replicas=64, routers=1, k=8, concurrency=6)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        stack = await start_stack(p, tmp_path / "pool", http)
        load = Load()
        workers = [
            asyncio.create_task(worker(http, stack.router_urls, p, load, i))
            for i in range(p.concurrency)
        ]
        try:
            async with Browser(tmp_path / "profile") as b:
                await b.open(stack.router_urls[0] + "/dashboard", width=1100, height=1300)
                # some history before the first update: the page has drawn three polls
                await drawn(b, lambda d: d["timeline"] >= 3)
                gens = [(await push(http, stack, n, p))["generation"] for n in (1, 2)]
                # the page polls once a second: wait until it shows the end (the assertions
                # below), however slowly a loaded host lets it poll and paint
                dom = await drawn(
                    b,
                    lambda d: (
                        d["states"] == [f"READY:{gens[-1]}"] * 64
                        and d["timeline"] >= 5
                        and d["rates"] >= 5
                        and d["updates"] >= 2
                        and f"published generation: {gens[-1]}" in d["text"]
                    ),
                )
                shot = await b.screenshot()
        finally:
            load.stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(stack.stop)
    d = json.loads(dom)
    assert d["cells"] == 64
    assert d["states"] == [f"READY:{gens[-1]}"] * 64
    assert d["timeline"] >= 5 and d["rates"] >= 5  # drawn from polls, not just the first paint
    assert d["updates"] >= 2 and f"published generation: {gens[-1]}" in d["text"]
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    keep = os.environ.get("ROLLOUTPOOL_DASHBOARD_SHOT")
    for path in [tmp_path / "dashboard-64.png", *([Path(keep)] if keep else [])]:
        await asyncio.to_thread(path.write_bytes, shot)
        print(f"dashboard screenshot: {path} ({len(shot)} bytes)")
