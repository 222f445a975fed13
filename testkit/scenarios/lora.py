"""LoRA generations on real vLLM CPU replicas: updates under load with no drain, and the
prefix-cache control.

    python -m bench.lora [--updates 10]

Setup: a local redis-server; 2 vLLM CPU replicas of the tiny LoRA base
(:func:`rolloutpool.local.lora_models.build_lora_base`: it emits ``marker_token(0)``), started with
``--enable-lora``; the updater in this process with ``generations: lora``; the router as a separate
process with ``generations: lora``. Generation g >= 1 is the marker adapter of ``marker_token(g)``
(:func:`rolloutpool.local.lora_models.build_marker_adapter`), so a rollout's tokens name the
generation that produced them. A load generator sends rollouts through the router (single requests
and 3-request sessions, temperature 1.0); after the warm-up pushes come ``rounds`` rounds of a
steady phase and an update phase (``updates / rounds`` pushes, one every ``gap_s``).

Measured:

* ``cross_generation``: rollouts with one token that is not their bound generation's marker;
* ``min_admitting_replicas``: sampled every 20 ms from the store (READY on an admissible
  generation: at least ``latest - max_staleness``), over the whole run;
* ``push_to_all_admitting_s``: per push, from the submit to every replica READY on the new
  generation with the generation published, at the store's time of the last of those writes
  (the journal's timestamps: :func:`admitting_at`); ``observed_push_to_all_admitting_s``: the
  same until a poller in this process (every 10 ms) saw it, which adds this process's delay
  (it also runs the updater and the load generator);
* ``update_phases``: per push, each replica's seconds per phase (``wait`` for its lock,
  ``load``, ``validate``, ``admit``; with ``lora_checksums``, beside the probe and so inside
  ``validate``: ``checksums``, the workers' answer, and ``checksums_expected``, the
  directory's computed here); ``submit_s_each``: per push, the submit call itself;
  ``checksums_each``: per push, whether ``lora_checksums`` was on (:attr:`Params.checksums`);
* ``throughput_through_updates_over_steady``: completed rollouts/s in the update phases over
  the steady phases (each round has one of each, equally long; ``rounds`` alternate them, and
  ``throughput_over_steady_by_round`` has each round's ratio);
* ``prefix_control``: on one replica, a 300-token prompt sent with one ``cache_salt`` through
  adapter g, then g+1, then g+1 again (vLLM's ``prefix_cache_hits`` counter read around each):
  g+1 must get 0 hits from g's blocks, and hits from its own;
* ``restart``: r1's server SIGKILLed after the updates: whether and when it is READY again on
  the latest generation in a new process (the base, then the live adapters: I6);
* ``served_at_end``: what each replica still holds once the control's session closed (the
  retired adapters are gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pool.adapters import adapter_name
from pool.engine import VllmEngine
from pool.engine_adapters import served_adapters
from pool.launcher import ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.harness import local_launcher
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from testkit.scenarios.rolling import observer_store, start_router, wait_http
from updater.api import ProbeSpec, UpdateRequest
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

S = ReplicaState
PROBE_PROMPT = list(range(10, 26))
NAMESPACE = "lora"


@dataclass
class Params:
    updates: int = 10
    concurrency: int = 4
    session_share: float = 0.3
    max_tokens: int = 16
    steady_s: float = 8.0
    gap_s: float = 0.8
    max_staleness: int = 0
    #: ``lora``: adapter pushes on LoRA replicas; ``weights``: the same policies merged into
    #: full checkpoints, pushed to replicas of the same base without LoRA (rolling, drained).
    mode: str = "lora"
    #: Pushes before the steady phase (not measured; the first loads warm vLLM's LoRA slots).
    warmup_pushes: int = 2
    #: The measured part is ``rounds`` x (``steady_s`` without a push, then ``updates / rounds``
    #: pushes every ``gap_s``), with ``settle_s`` unmeasured between rounds, so that the box's
    #: noise falls on both phases alike.
    rounds: int = 1
    settle_s: float = 1.0
    #: ``lora``: after the updates, SIGKILL r1; it must come back on the latest generation
    #: (a fresh process on the base, then the live adapters).
    restart: bool = True
    #: ``lora``: the measured pushes alternate without and with ``lora_checksums`` (the first
    #: without), so that its cost is measured beside the default's in one run; False: never.
    checksums: bool = True


@dataclass
class Rollout:
    id: str
    kind: str
    generation: int
    tokens: list[int]
    t_end: float


@dataclass
class Run:
    rollouts: list[Rollout] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    min_admitting: int = 99
    samples: int = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def rate(self, t_from: float, t_to: float) -> float:
        return self.rate_over([(t_from, t_to)])

    def rate_over(self, windows: list[tuple[float, float]]) -> float:
        """Rollouts completed per second within the windows (their ends), over their total time."""
        n = sum(1 for r in self.rollouts for a, b in windows if a <= r.t_end < b)
        return n / max(sum(b - a for a, b in windows), 1e-9)


def adapter_dir(g: int) -> Path:
    return ensure_model("lora-marker", token_id=marker_token(g))


def checkpoint(p: Params, g: int) -> Path:
    """What generation ``g`` pushes: its marker adapter, or (``weights``) that merged."""
    if p.mode == "weights":
        return ensure_model("lora-merged", token_id=marker_token(g))
    return adapter_dir(g)


def _completion(rng: random.Random, p: Params, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "rolloutpool",
        "prompt": [rng.randrange(3, 2000) for _ in range(8)],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }


async def _single(http: httpx.AsyncClient, rng: random.Random, p: Params, run: Run) -> None:
    r = await http.post("/v1/completions", json=_completion(rng, p, p.max_tokens))
    if r.status_code != 200:
        run.error(f"single {r.status_code}")
        return
    data = r.json()
    info = data["rollout"]
    tokens = data["choices"][0]["token_ids"]
    gen = Generation(number=int(info["generation"]), label=info["label"])
    if p.mode == "lora" and info.get("adapter") != adapter_name(gen):  # g0: none
        run.error(f"rollout object names adapter {info.get('adapter')!r}")
    run.rollouts.append(
        Rollout(info["id"], "single", int(info["generation"]), tokens, time.monotonic())
    )


async def _session(http: httpx.AsyncClient, rng: random.Random, p: Params, run: Run) -> None:
    r = await http.post("/v1/rollouts", json={})
    if r.status_code != 201:
        run.error(f"session-open {r.status_code}")
        return
    s = r.json()
    rid, tokens = s["rollout_id"], []
    try:
        for _ in range(3):
            body = _completion(rng, p, p.max_tokens // 2)
            t = await http.post("/v1/completions", json=body, headers={"X-Rollout-Id": rid})
            if t.status_code != 200:
                run.error(f"session-turn {t.status_code}")
                return
            tokens += t.json()["choices"][0]["token_ids"]
    finally:
        await http.post(f"/v1/rollouts/{rid}/close")
    run.rollouts.append(Rollout(rid, "session", int(s["generation"]), tokens, time.monotonic()))


async def _load(url: str, p: Params, run: Run, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while not stop.is_set():
            try:
                if rng.random() < p.session_share:
                    await _session(http, rng, p, run)
                else:
                    await _single(http, rng, p, run)
            except httpx.HTTPError as e:
                run.error(type(e).__name__)
                await asyncio.sleep(0.1)


async def _sampler(store: RedisStore, p: Params, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        latest, recs = await asyncio.gather(store.latest(), store.replicas())
        if latest is not None:
            floor = latest[0].number - p.max_staleness
            n = sum(1 for r in recs if r.state is S.READY and (r.generation or 0) >= floor)
            run.min_admitting = min(run.min_admitting, n)
            run.samples += 1
        await asyncio.sleep(0.02)


async def admitting_at(store: RedisStore, g: int, since_ms: int, replicas: int) -> int | None:
    """The store's time (Redis ms) at which generation ``g`` was admitting on every one of
    ``replicas`` replicas: the later of its publish and each replica's first move into READY on
    it, from the journal written since ``since_ms``; None if that has not happened."""
    published: int | None = None
    ready: dict[str, int] = {}
    for e in await store.journal(start=str(since_ms)):
        f, ts = e.fields, int(e.fields.get("ts", 0))
        if f.get("generation") != str(g):
            continue
        if e.type == "publish" and published is None:
            published = ts
        elif e.type == "transition" and f.get("to") == S.READY.value:
            ready.setdefault(f.get("replica", ""), ts)
    if published is None or len(ready) < replicas:
        return None
    return max(published, *ready.values())


async def push(up: Updater, store: RedisStore, path: Path, g: int) -> dict[str, Any]:
    """Push ``path`` as generation ``g``; returns the update record plus ``all_admitting_s``
    (from the submit to :func:`admitting_at`), ``observed_all_admitting_s`` (until a poller
    here, every 10 ms, saw it in the store: that adds this process's own delay) and
    ``submit_s`` (the submit call)."""
    t0, t0_ms = time.monotonic(), int(time.time() * 1000)
    rec = await up.submit(
        UpdateRequest(
            checkpoint=str(path),
            step=g,
            trainer_run="lora-bench",
            probe=ProbeSpec(
                prompt_token_ids=PROBE_PROMPT, expected_token_ids=[marker_token(g)] * 4
            ),
        )
    )
    submit_s = time.monotonic() - t0
    observed: float | None = None
    while time.monotonic() - t0 < 120:
        if observed is None:
            latest, recs = await asyncio.gather(store.latest(), store.replicas())
            if (
                latest is not None
                and latest[0].number >= rec.generation
                and all(r.state is S.READY and r.generation == rec.generation for r in recs)
            ):
                observed = time.monotonic() - t0
        cur = await up.get(rec.id)
        if cur.state.value in ("succeeded", "failed", "superseded") and observed is not None:
            break
        if cur.state.value in ("failed", "superseded"):
            break
        await asyncio.sleep(0.01)
    out = (await up.get(rec.id)).model_dump(mode="json")
    at = await admitting_at(store, rec.generation, t0_ms, len(up.replicas))
    out["all_admitting_s"] = None if observed is None or at is None else (at - t0_ms) / 1000
    out["observed_all_admitting_s"] = None if observed is None else round(observed, 4)
    out["submit_s"] = round(submit_s, 4)
    return out


async def prefix_control(url: str, g: int) -> dict[str, Any]:
    """On the replica at ``url`` (serving adapters g and g+1), one 300-token prompt with one
    salt: through g, through g+1, through g+1 again; vLLM's prefix-cache hits around each."""
    prompt = [3 + (i * 37) % 1990 for i in range(300)]
    async with VllmEngine(url, timeout=60) as engine:
        out: dict[str, Any] = {}
        for step, n in (("g", g), ("g+1", g + 1), ("g+1 again", g + 1), ("g again", g)):
            name = adapter_name(Generation(number=n, label=f"g{n}"))
            before = (await engine.metrics()).prefix_cache_hits
            ids = await engine.complete(
                prompt, max_tokens=4, extra={"model": name}, cache_salt="control"
            )
            after = (await engine.metrics()).prefix_cache_hits
            out[step] = {"adapter": name, "hits": after - before, "tokens": list(ids)}
        return out


async def _prefix_or_why(
    up: Updater, store: RedisStore, url: str, g: int, rid: str, replica: str
) -> dict[str, Any]:
    """:func:`prefix_control`, or a RuntimeError saying what the pool held when it failed."""
    try:
        return await prefix_control(url, g)
    except Exception as e:  # diagnostics for a failed control
        binding = await store.binding(rid)
        served = {
            m.id: await served_adapters(m.handle.engine, timeout_s=10) for m in up.replicas.values()
        }
        raise RuntimeError(
            f"control failed on {replica}: {e}; session binding {binding}; "
            f"served {served}; holds {await store.adapters.holds(replica)}"
        ) from e


async def _heartbeat(http: httpx.AsyncClient, rid: str) -> None:
    """Keep session ``rid``'s lease while it holds its generation without requests."""
    while True:
        await http.post(f"/v1/rollouts/{rid}/heartbeat")
        await asyncio.sleep(1.0)


async def _control(up: Updater, store: RedisStore, url: str, p: Params, g: int) -> dict[str, Any]:
    """The prefix-cache control: a session holds g-1 on its replica while g is pushed beside
    it; then what the pool unloads once the session closed."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        opened = (await http.post("/v1/rollouts", json={})).json()
        rid = opened["rollout_id"]
        turn = await http.post(
            "/v1/completions",
            json={"model": "rolloutpool", "prompt": [5, 6, 7], "max_tokens": 2},
            headers={"X-Rollout-Id": rid},
        )
        replica = turn.json()["rollout"]["replica"]
        beat = asyncio.create_task(_heartbeat(http, rid))  # the control outlasts a lease
        try:
            pushed = await push(up, store, checkpoint(p, g), g)
            rec = await store.replica(replica)
            control = await _prefix_or_why(up, store, rec.url, g - 1, rid, replica)
        finally:
            beat.cancel()
        await http.post(f"/v1/rollouts/{rid}/close")
    retired_wait = time.monotonic()
    while time.monotonic() - retired_wait < 10:  # the session's g goes once it closed
        held = {
            m.id: await served_adapters(m.handle.engine, timeout_s=10) for m in up.replicas.values()
        }
        if all(len(v) == 1 for v in held.values()):
            break
        await asyncio.sleep(0.2)
    return {
        "prefix_control": control,
        "control_push": {"state": pushed["state"], "all_admitting_s": pushed["all_admitting_s"]},
        "stale_prefix_hits_across_adapters": control["g+1"]["hits"],
        "served_at_end": held,
    }


async def _restart(up: Updater, store: RedisStore) -> dict[str, Any]:
    """SIGKILL r1's server; wait until the supervisor has it READY on the latest generation in
    a new process; what it serves then."""
    before = await store.replica("r1")
    t0 = time.monotonic()
    local_launcher(up, "r1").kill()
    recovered = False
    while time.monotonic() - t0 < 360:  # a start on a loaded 2-core box: up to minutes
        r1, latest = await asyncio.gather(store.replica("r1"), store.latest())
        if (
            r1.state is S.READY
            and r1.process != before.process
            and latest is not None
            and r1.generation == latest[0].number
        ):
            recovered = True
            break
        await asyncio.sleep(0.2)
    m = up.replicas["r1"]
    return {
        "recovered": recovered,
        "recovered_after_s": round(time.monotonic() - t0, 1),
        "generation": r1.generation,
        "served": await served_adapters(m.handle.engine, timeout_s=10) if recovered else {},
    }


def _replicas(workdir: Path, base: Path, p: Params) -> list[ReplicaConfig]:
    return [
        ReplicaConfig(
            id=f"r{i}",
            model=base,
            launch=ReplicaSpec(
                model=base,
                name=f"lora-r{i}",
                cpu_bind=str(i),
                work_dir=workdir / f"r{i}",
                max_loras=p.max_staleness + 3 if p.mode == "lora" else None,
                max_lora_rank=8,
                startup_timeout_s=240.0,
                # the updater compares each loaded adapter's factors through it
                extra_args=("--worker-extension-cls", "pool.replica_extension.WeightExtension"),
            ),
        )
        for i in range(2)
    ]


async def scenario(p: Params, workdir: Path) -> dict[str, Any]:
    if p.updates % p.rounds:
        raise ValueError(f"{p.updates} updates do not split into {p.rounds} equal rounds")
    t_start = time.monotonic()
    base = await asyncio.to_thread(ensure_model, "lora-base")
    last = p.warmup_pushes + p.updates + 1
    for g in range(1, last + 1):
        await asyncio.to_thread(checkpoint, p, g)
    shutil.rmtree(workdir / "redis", ignore_errors=True)  # generation numbers start at 0
    redis = RedisServer(workdir / "redis").start()
    store = observer_store(redis.url, NAMESPACE)  # the scenario's own reads
    updater_store = RedisStore.connect(StoreSettings(url=redis.url, namespace=NAMESPACE))
    settings = UpdaterSettings(
        replicas=_replicas(workdir, base, p),
        generations="lora" if p.mode == "lora" else "weights",
        max_lora_rank=8,
        lora_checksums=p.mode == "lora" and p.checksums,
        max_staleness=p.max_staleness,
        health_interval_s=0.5,
        retire_interval_s=0.5,
    )
    up = Updater(settings, updater_store)
    routers = []
    run = Run()
    stop = asyncio.Event()
    try:
        await up.start()
        port = free_port()
        env = {
            "ROLLOUTPOOL_ROUTER_GENERATIONS": settings.generations,
            "ROLLOUTPOOL_ROUTER_MAX_STALENESS": str(p.max_staleness),
            "ROLLOUTPOOL_REDIS_NAMESPACE": NAMESPACE,
        }
        routers.append(start_router(port, redis.url, 3.0, env))
        url = f"http://127.0.0.1:{port}"
        await wait_http(url + "/healthz")
        bg = [asyncio.create_task(_load(url, p, run, stop, seed)) for seed in range(p.concurrency)]
        bg.append(asyncio.create_task(_sampler(store, p, run, stop)))
        # steady = serving an adapter generation, as the update phase does: vLLM's LoRA
        # kernels cost more than the bare base model's, and that is not the updates' cost
        warmup = [await push(up, store, checkpoint(p, g), g) for g in range(1, p.warmup_pushes + 1)]
        await asyncio.sleep(2.0)  # warm-up, not measured
        updates: list[dict[str, Any]] = []
        steady_w: list[tuple[float, float]] = []  # (from, to) of each round's phases
        update_w: list[tuple[float, float]] = []
        generations = iter(range(p.warmup_pushes + 1, last))
        for _ in range(p.rounds):
            if steady_w:
                await asyncio.sleep(p.settle_s)  # the last push's retiring, not measured
            t_steady = time.monotonic()
            await asyncio.sleep(p.steady_s)
            t_updates = time.monotonic()
            for i in range(1, p.updates // p.rounds + 1):
                g = next(generations)
                if up.lora is not None:
                    up.lora.checksums = p.checksums and len(updates) % 2 == 1
                updates.append(await push(up, store, checkpoint(p, g), g))
                updates[-1]["checksums"] = up.lora is not None and up.lora.checksums
                await asyncio.sleep(max(t_updates + i * p.gap_s - time.monotonic(), 0.0))
            steady_w.append((t_steady, t_updates))
            update_w.append((t_updates, time.monotonic()))
        stop.set()
        await asyncio.gather(*bg)
        result: dict[str, Any] = {}
        if p.mode == "lora":
            if p.restart:
                result["restart"] = await _restart(up, store)
            result.update(await _control(up, store, url, p, last))
        bad = [r.id for r in run.rollouts if any(t != marker_token(r.generation) for t in r.tokens)]
        steady, through = run.rate_over(steady_w), run.rate_over(update_w)
        rounds = [(run.rate(*q), run.rate(*u)) for q, u in zip(steady_w, update_w, strict=True)]
        by_round = [round(u / q, 3) if q else None for q, u in rounds]
        admitting = [u["all_admitting_s"] for u in updates]  # None: never seen admitting
        observed = [
            u["observed_all_admitting_s"]
            for u in updates
            if u["observed_all_admitting_s"] is not None
        ]
        return {
            "mode": p.mode,
            "updates": sum(1 for u in updates if u["state"] == "succeeded"),
            "updates_failed": [u for u in updates if u["state"] != "succeeded"][:3],
            "rollouts": len(run.rollouts),
            "rollouts_by_kind": {
                k: sum(1 for r in run.rollouts if r.kind == k) for k in ("single", "session")
            },
            "generations_seen": sorted({r.generation for r in run.rollouts}),
            "cross_generation": len(bad),
            "cross_generation_ids": bad[:10],
            "min_admitting_replicas": run.min_admitting,
            "replicas": len(up.replicas),
            "admitting_samples": run.samples,
            "steady_rollouts_per_s": round(steady, 2),
            "through_updates_rollouts_per_s": round(through, 2),
            "throughput_through_updates_over_steady": (
                round(through / steady, 3) if steady else None
            ),
            "throughput_over_steady_by_round": by_round,
            "push_to_all_admitting_s": max((a for a in admitting if a is not None), default=None),
            "push_to_all_admitting_s_each": admitting,
            "observed_push_to_all_admitting_s": max(observed, default=None),
            "observed_push_to_all_admitting_s_each": observed,
            "warmup_push_to_all_admitting_s": [u["all_admitting_s"] for u in warmup],
            "update_phases": [
                {rid: r["phases"] for rid, r in u["replicas"].items()} for u in updates
            ],
            "submit_s_each": [u["submit_s"] for u in updates],
            "checksums_each": [u["checksums"] for u in updates],
            **result,
            "client_errors": run.errors,
            "wall_s": round(time.monotonic() - t_start, 1),
            "params": p.__dict__,
        }
    finally:
        stop.set()
        for proc in routers:
            terminate(proc)
        with contextlib.suppress(Exception):
            await up.stop()
        await updater_store.close()
        await store.close()
        redis.stop()
