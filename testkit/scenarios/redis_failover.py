"""Redis failovers under rollout load, on real processes (``bench/redis_failover.py`` and the CI
test ``tests/integration/test_redis_failover.py``).

Setup: a :class:`~testkit.redis_ha.SentinelGroup` (one primary, two replicas, three
``redis-sentinel`` processes; ``down-after-milliseconds`` 1000, ``min-replicas-to-write`` 1);
two vLLM CPU replicas serving *marker* checkpoints (generation g emits token T_g for any
prompt); the updater in this process and the router as a separate process, both on the
sentinels (``wait_replicas`` 1). Load: single requests and 2-request sessions at temperature
1.0, continuously; a pusher publishes a new generation whenever the last update ended. An
admission probe opens (and closes) a session every 100 ms to time the 503s.

Failover kinds (each: the primary is SIGKILLed at the moment named, then restarted as a
replica once the sentinels promoted another node):

* ``steady`` — while rollouts run and no update is in flight;
* ``draining`` — while a replica is DRAINING;
* ``admit_burst`` — right after a burst of 16 concurrent admissions;
* ``mid_transition`` — while a replica is QUIESCED..RESUMING;
* ``sigstop`` — the primary is SIGSTOPped until the sentinels promoted another node, then
  SIGCONTed: a pool write sent straight to it must be refused (``old_primary_write``).

Reported per failover: ``unavailable_s`` (probe time without a successful admission after the
kill), ``promoted_after_s``, ``admitting_after_promotion_s``, rollouts cut
(``binding_lost``/``binding_ended``) and recorded lost, the updater's fencing token before and
after, and the updates that succeeded after it. At the end every rollout the client saw is
looked up in the final store: one without a record, or still active, is ``silently_lost``; one
whose tokens are not all its generation's marker is ``cross_generation``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pool.errors import NotFound, RolloutPoolError
from pool.launcher import ReplicaSpec
from pool.store import RedisStore, describe_token
from pool.types import BindingState, ReplicaState
from rolloutpool.local.models import marker_token
from testkit.redis_ha import SentinelGroup, command
from testkit.redis_server import free_port
from testkit.scenarios.rolling import (
    NAMESPACE,
    PROBE_PROMPT,
    STARTUP_TIMEOUT_S,
    Rollout,
    marker,
    start_router,
    wait_http,
)
from updater.api import ProbeSpec, UpdateRequest
from updater.cycle import Deadlines
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

S = ReplicaState
KINDS = ("steady", "draining", "admit_burst", "mid_transition", "sigstop")
#: Generation g serves the marker checkpoint of ``g % MARKERS`` (consecutive generations always
#: differ, so a rollout spanning a weight change still shows two markers).
MARKERS = 6


def _marker_of(g: int) -> int:
    return marker_token(g % MARKERS)


IN_TRANSITION = {S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING, S.RESUMING}


@dataclass
class Params:
    per_kind: int = 5
    kinds: tuple[str, ...] = KINDS
    concurrency: int = 4
    max_tokens: int = 16
    settle_s: float = 4.0  # load between failovers, after the pool is whole again
    stop_s: float = 6.0  # SIGSTOP length (> min-replicas-max-lag)
    condition_timeout_s: float = 90.0
    down_after_ms: int = 1000  # the sentinels' down-after-milliseconds


@dataclass
class Seen:
    """Everything the clients saw."""

    rollouts: list[Rollout] = field(default_factory=list)
    cut: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (code, when)
    statuses: dict[str, int] = field(default_factory=dict)
    probe: list[tuple[float, bool]] = field(default_factory=list)  # (time, admitted)
    updates: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, state
    markers: dict[int, int] = field(default_factory=lambda: {0: marker_token(0)})

    def status(self, what: str) -> None:
        self.statuses[what] = self.statuses.get(what, 0) + 1


def cross_generation(rollouts: list[Rollout], markers: dict[int, int]) -> list[str]:
    """Rollouts with a token that is not the marker of their bound generation (``markers``:
    generation number -> its checkpoint's marker token, as submitted)."""
    return [r.id for r in rollouts if any(t != markers.get(r.generation) for t in r.tokens)]


async def push(up: Updater, g: int, timeout_s: float, seen: Seen) -> str:
    """Push the checkpoint of marker ``g % MARKERS``; record which generation number the
    updater gave it; returns the final state (with the error of a failed update)."""
    rec = await up.submit(
        UpdateRequest(
            checkpoint=str(marker(g % MARKERS)),
            step=g,
            trainer_run="failover-bench",
            probe=ProbeSpec(prompt_token_ids=PROBE_PROMPT, expected_token_ids=[_marker_of(g)] * 4),
        )
    )
    seen.markers[rec.generation] = _marker_of(g)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cur = await up.get(rec.id)
        if cur.state.value in ("succeeded", "superseded"):
            return cur.state.value
        if cur.state.value == "failed":
            return f"failed: {(cur.error or '')[:100]}"
        await asyncio.sleep(0.05)
    raise TimeoutError(f"update to g{g}")


def _body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "rolloutpool",
        "prompt": [rng.randrange(3, 2000) for _ in range(8)],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }


def _note_cut(seen: Seen, r: httpx.Response) -> None:
    try:
        err = r.json().get("error", {})
    except ValueError:
        return
    ro = err.get("rollout") or {}
    if isinstance(ro, dict) and ro.get("id"):
        seen.cut[str(ro["id"])] = (str(err.get("code")), time.monotonic())


async def _one(http: httpx.AsyncClient, rng: random.Random, p: Params, seen: Seen) -> None:
    if rng.random() < 0.25:  # a 2-request session
        r = await http.post("/v1/rollouts", json={})
        seen.status(f"session-open {r.status_code}")
        if r.status_code != 201:
            return
        s = r.json()
        rid, tokens = s["rollout_id"], []
        try:
            for _ in range(2):
                t = await http.post(
                    "/v1/completions",
                    json=_body(rng, p.max_tokens // 2),
                    headers={"X-Rollout-Id": rid},
                )
                seen.status(f"session-turn {t.status_code}")
                if t.status_code != 200:
                    seen.cut.setdefault(rid, (f"turn {t.status_code}", time.monotonic()))
                    return
                tokens += t.json()["choices"][0]["token_ids"]
        finally:
            await http.post(f"/v1/rollouts/{rid}/close")
        seen.rollouts.append(
            Rollout(rid, "session", int(s["generation"]), tokens, time.monotonic())
        )
        return
    r = await http.post("/v1/completions", json=_body(rng, p.max_tokens))
    seen.status(f"single {r.status_code}")
    if r.status_code != 200:
        _note_cut(seen, r)
        return
    data = r.json()
    seen.rollouts.append(
        Rollout(
            data["rollout"]["id"],
            "single",
            int(data["rollout"]["generation"]),
            data["choices"][0]["token_ids"],
            time.monotonic(),
        )
    )


async def _load(url: str, p: Params, seen: Seen, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            try:
                await _one(http, rng, p, seen)
            except httpx.HTTPError as e:
                seen.status(type(e).__name__)
                await asyncio.sleep(0.1)


async def _probe(url: str, seen: Seen, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            ok = False
            try:
                r = await http.post("/v1/rollouts", json={})
                ok = r.status_code == 201
                if ok:
                    await http.post(f"/v1/rollouts/{r.json()['rollout_id']}/close")
            except httpx.HTTPError:
                pass
            seen.probe.append((time.monotonic(), ok))
            await asyncio.sleep(0.1)


async def _pusher(up: Updater, seen: Seen, stop: asyncio.Event) -> None:
    while not stop.is_set():
        g = max(seen.markers) + 1  # the generation number the next submit gets
        t0 = time.monotonic()
        try:
            state = await push(up, g, 240, seen)
        except (RolloutPoolError, TimeoutError) as e:
            state = f"error: {type(e).__name__}: {str(e)[:100]}"
        seen.updates.append((t0, time.monotonic(), state))
        await asyncio.sleep(0.5 if state == "succeeded" else 2.0)


async def _until(what: str, check: Any, timeout_s: float, poll_s: float = 0.02) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await check():
                return time.monotonic()
        except RolloutPoolError:
            pass
        await asyncio.sleep(poll_s)
    raise TimeoutError(what)


async def _states(store: RedisStore) -> set[S]:
    return {r.state for r in await store.replicas()}


async def _pool_whole(store: RedisStore, up: Updater) -> bool:
    recs = await store.replicas()
    latest = await store.latest()
    return (
        latest is not None
        and all(r.state is S.READY for r in recs)
        and all(m.handle.lc.state is S.READY for m in up.replicas.values())
    )


async def _burst(url: str, n: int = 16) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        rng = random.Random(n)
        tasks = [
            asyncio.create_task(http.post("/v1/completions", json=_body(rng, 64))) for _ in range(n)
        ]
        await asyncio.sleep(0.15)  # the admissions are in; the generations run
        await asyncio.gather(*tasks, return_exceptions=True)


async def failover(
    kind: str,
    group: SentinelGroup,
    store: RedisStore,
    up: Updater,
    url: str,
    p: Params,
    seen: Seen,
) -> dict[str, Any]:
    """One failover of ``kind`` (see the module docstring); returns its row."""
    await _until("pool whole", lambda: _pool_whole(store, up), 300, 0.2)
    await asyncio.sleep(p.settle_s)
    old = group.primary_port()  # read before the moment, so the kill follows it at once
    epoch_before = max(group.epochs())
    if kind == "draining":
        await _until("a DRAINING replica", lambda: _has(store, {S.DRAINING}), p.condition_timeout_s)
    elif kind == "mid_transition":
        await _until(
            "a replica mid-update",
            lambda: _in(up, IN_TRANSITION),
            p.condition_timeout_s,
            0.005,
        )
    burst = asyncio.create_task(_burst(url)) if kind == "admit_burst" else None
    if burst is not None:
        await asyncio.sleep(0.1)
    token_before = up.lease.token
    t_kill = time.monotonic()
    row: dict[str, Any] = {"kind": kind}
    if kind == "sigstop":
        group.node(old).signal(signal.SIGSTOP)
        row["states_at_kill"] = sorted({str(m.handle.lc.state) for m in up.replicas.values()})
        new, t_promoted = await asyncio.to_thread(group.wait_promoted, old, 60)
        await asyncio.sleep(max(0.0, p.stop_s - (time.monotonic() - t_kill)))
        group.node(old).signal(signal.SIGCONT)
        key = "{" + NAMESPACE + "}:probe"
        row["old_primary_write"] = await asyncio.to_thread(command, old, "SET", key, "x")
    else:
        group.node(old).signal(signal.SIGKILL)
        # the updater's controllers (the store is gone for now): what the kill interrupted
        row["states_at_kill"] = sorted({str(m.handle.lc.state) for m in up.replicas.values()})
        new, t_promoted = await asyncio.to_thread(group.wait_promoted, old, 60)
    t_admit = await _until(
        "admitting again",
        lambda: _admitted_after(seen, t_promoted),
        120,
        0.05,
    )
    if burst is not None:
        await burst
    if kind != "sigstop":
        await asyncio.to_thread(group.restart, old)
    await asyncio.to_thread(group.wait_replicas_synced, None, 2, 120)
    epoch_after = max(group.epochs())
    row["extra_failovers"] = epoch_after - epoch_before - 1  # spurious ones (a starved box)
    row.update(
        {
            "primary_before": old,
            "primary_after": new,
            "epoch_before": epoch_before,
            "epoch_after": epoch_after,
            "promoted_after_s": round(t_promoted - t_kill, 2),
            "admitting_after_promotion_s": round(t_admit - t_promoted, 2),
            "t_kill": t_kill,
            "token_before": None if token_before is None else describe_token(token_before),
            "token_before_raw": token_before,
        }
    )
    return row


async def _admitted_after(seen: Seen, t: float) -> bool:
    return any(ok and when > t for when, ok in reversed(seen.probe))


async def _in(up: Updater, states: set[S]) -> bool:
    """A replica's controller is in ``states`` (no round trip: the kill follows at once)."""
    return any(m.handle.lc.state in states for m in up.replicas.values())


async def _has(store: RedisStore, states: set[S]) -> bool:
    return bool(await _states(store) & states)


def _unavailable_s(probe: list[tuple[float, bool]], t_kill: float, t_end: float) -> float:
    """Seconds after ``t_kill`` (until ``t_end``) in which the probe did not admit: from each
    failed probe to the next probe."""
    rows = [(t, ok) for t, ok in probe if t_kill <= t <= t_end]
    return round(sum(b[0] - a[0] for a, b in itertools.pairwise(rows) if not a[1]), 2)


async def scenario(p: Params, workdir: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    await asyncio.gather(*(asyncio.to_thread(marker, g) for g in range(MARKERS)))
    group = SentinelGroup(workdir / "redis", down_after_ms=p.down_after_ms)
    await asyncio.to_thread(group.start)
    # every rollout's record is checked at the end: keep them for the whole run
    settings = group.store_settings(
        NAMESPACE, socket_timeout_s=1.0, failover_grace_s=10.0, binding_retention_s=7200.0
    )
    store = RedisStore.connect(settings)
    base = marker(0)
    replicas = [
        ReplicaConfig(
            id=f"r{i}",
            model=base,
            launch=ReplicaSpec(
                model=base,
                name=f"fo-r{i}",
                cpu_bind=str(i),
                work_dir=workdir / f"r{i}",
                startup_timeout_s=STARTUP_TIMEOUT_S,
            ),
        )
        for i in range(2)
    ]
    up = Updater(
        UpdaterSettings(
            replicas=replicas,
            health_interval_s=0.5,
            health_failures=3,
            deadlines=Deadlines(transfer_s=60.0),
            drain_timeout_s=10.0,
        ),
        store,
    )
    seen = Seen()
    stop = asyncio.Event()
    router: subprocess.Popen[bytes] | None = None
    rows: list[dict[str, Any]] = []
    try:
        await up.start()
        port = free_port()
        env = {
            "ROLLOUTPOOL_REDIS_SENTINELS": ",".join(settings.sentinels),
            "ROLLOUTPOOL_REDIS_SENTINEL_SERVICE": settings.sentinel_service,
            "ROLLOUTPOOL_REDIS_WAIT_REPLICAS": "1",
            "ROLLOUTPOOL_REDIS_SOCKET_TIMEOUT_S": "1",
            "ROLLOUTPOOL_REDIS_FAILOVER_GRACE_S": "10",
            "ROLLOUTPOOL_REDIS_BINDING_RETENTION_S": "7200",
        }
        router = start_router(port, "redis://unused:1/0", 3.0, env)
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/healthz")
        bg = [asyncio.create_task(_load(url, p, seen, stop, s)) for s in range(p.concurrency)]
        bg += [
            asyncio.create_task(_probe(url, seen, stop)),
            asyncio.create_task(_pusher(up, seen, stop)),
        ]
        for kind in [k for k in p.kinds for _ in range(p.per_kind)]:
            try:
                rows.append(await failover(kind, group, store, up, url, p, seen))
            except Exception as e:  # reported in the result, the run goes on
                rows.append({"kind": kind, "error": f"{type(e).__name__}: {e}"})
            print(f"failover {len(rows)}: {rows[-1]}", flush=True)
        await asyncio.sleep(p.settle_s)
        stop.set()
        await asyncio.gather(*bg, return_exceptions=True)
        await asyncio.sleep(4.0)  # the reaper (3 s leases) settles what the failovers left
        return await _report(rows, seen, store, up, p, time.monotonic() - t_start)
    finally:
        stop.set()
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(10)
        await up.stop()
        await store.close()
        await asyncio.to_thread(group.stop)


async def _report(
    rows: list[dict[str, Any]],
    seen: Seen,
    store: RedisStore,
    up: Updater,
    p: Params,
    wall_s: float,
) -> dict[str, Any]:
    done = [r for r in rows if "t_kill" in r]
    kills = [r["t_kill"] for r in done] + [float("inf")]
    for i, r in enumerate(done):
        t_next = kills[i + 1]
        r["unavailable_s"] = _unavailable_s(seen.probe, r["t_kill"], min(t_next, r["t_kill"] + 60))
        r["updates_after"] = sum(
            1 for a, _, s in seen.updates if r["t_kill"] < a < t_next and s == "succeeded"
        )
        r["updates_failed_after"] = sum(
            1 for a, _, s in seen.updates if r["t_kill"] < a < t_next and s != "succeeded"
        )
        window = [ro for ro in seen.rollouts if r["t_kill"] <= ro.t_end < t_next]
        r["rollouts_after"] = len(window)
        r["cross_generation"] = len(cross_generation(window, seen.markers))
        r["cut_with_reason"] = sum(1 for _, t in seen.cut.values() if r["t_kill"] <= t < t_next)
        after = up.lease.token if i == len(done) - 1 else done[i + 1]["token_before_raw"]
        r["token_after"] = None if after is None else describe_token(after)
        r["fencing_monotonic"] = after is not None and (
            r["token_before_raw"] is None or after >= r["token_before_raw"]
        )
    silently_lost, recorded_lost, still_active = [], 0, 0
    for rid in [ro.id for ro in seen.rollouts] + list(seen.cut):
        try:
            b = await store.binding(rid)
        except NotFound:
            silently_lost.append(rid)
            continue
        if b.state is BindingState.ACTIVE:
            still_active += 1
            silently_lost.append(rid)
        elif "lost in a Redis failover" in b.reason:
            recorded_lost += 1
    bad = cross_generation(seen.rollouts, seen.markers)
    for r in done:
        r.pop("t_kill")
        r.pop("token_before_raw")
    return {
        "failovers": len(done),
        "failovers_by_kind": {k: sum(1 for r in done if r["kind"] == k) for k in p.kinds},
        "failed_to_run": [r for r in rows if "error" in r],
        "rollouts": len(seen.rollouts),
        "cross_generation": len(bad),
        "cross_generation_ids": bad[:10],
        "silently_lost": len(silently_lost),
        "silently_lost_ids": silently_lost[:10],
        "still_active_at_end": still_active,
        "cut_with_reason": len(seen.cut),
        "cut_codes": _count(code for code, _ in seen.cut.values()),
        "recorded_lost_in_failover": recorded_lost,
        "max_unavailable_s": max((r["unavailable_s"] for r in done), default=None),
        "max_admitting_after_promotion_s": max(
            (r["admitting_after_promotion_s"] for r in done), default=None
        ),
        "fencing_monotonic": all(r["fencing_monotonic"] for r in done),
        "updates_after_failover": sum(r["updates_after"] for r in done),
        "updates": _count(s for _, _, s in seen.updates),
        "client_statuses": seen.statuses,
        "gate_waits_s": {str(k): round(v, 3) for k, v in up.runner.gate.waited_s.items()}
        if up.runner.gate is not None
        else {},
        "rows": done,
        "wall_s": round(wall_s, 1),
        "params": p.__dict__,
        "marker_tokens_checked": sum(len(r.tokens) for r in seen.rollouts),
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out
