"""The five strategies of the strategies benchmark, each as a request target and a ``publish``.

Baselines (no pool in the path; the clients talk to the replicas' ``/inference/v1/generate``,
one sample per replica, the least loaded; sessions stay on their replica) drive vLLM's native
endpoints on every replica at once, as those frameworks do:

* ``stop_the_world`` (verl, OpenRLHF, NeMo-RL): no new sample starts, the samples in flight
  (sessions too) finish, then on every replica ``/pause?mode=wait``, ``reload_weights``,
  ``/reset_prefix_cache`` (+ the other caches), the label ``g<step>``, ``/resume``; then the
  clients go on. Its samples are single-policy by construction.
* ``keep`` (PipelineRL, prime-rl, SkyRL, TRL async): ``/pause?mode=keep`` (vLLM's default
  ``clear_cache``, as the official async example), ``reload_weights``, label, ``/resume``:
  requests in flight continue on the new weights (two ``weight_versions`` spans, or markers).
* ``abort_resubmit`` (AReaL, slime): ``/pause?mode=abort``, ``reload_weights``, cache reset,
  label, ``/resume``; a client whose request came back ``finish_reason="abort"`` resubmits
  prompt + partial output for the tokens left (its re-prefilled tokens are wasted).

Requests sent to a paused vLLM 0.26 or 0.32 server queue and run after ``/resume`` (on the new
weights). vLLM 0.26 has no labels (the label step is a no-op there) and no spans.

The pool (``pool_strict``, ``pool_staleness1``): a fresh Redis, one ``python -m updater``
(the replicas as ``external`` replicas, ``reload`` transport) and one ``python -m router`` in
front of the same replicas (:class:`PoolStack`); the clients use the router's
``/v1/completions`` and ``/v1/rollouts`` sessions; ``publish`` is ``POST /v1/updates`` (the
trainer waits only for the 202), the update record is followed to its end in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from pool.engine import VllmEngine
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from testkit.scenarios.scale import _spawn, _wait_http
from testkit.scenarios.strategies.models import eos_marker, policy_marker
from testkit.scenarios.strategies.workload import (
    Load,
    Piece,
    TurnResult,
    pieces_of_markers,
    pieces_of_spans,
)

__all__ = [
    "BASELINES",
    "POOLS",
    "DirectTarget",
    "PoolStack",
    "PoolTarget",
    "Timeline",
    "baseline_publish",
    "prepare_replicas",
]

BASELINES = ("stop_the_world", "keep", "abort_resubmit")
POOLS = ("pool_strict", "pool_staleness1")
ADMIN = "strategies-bench-admin-5c1e"
PROBE_PROMPT = list(range(10, 26))
CONTROL_TIMEOUT_S = 600.0


@dataclass
class Timeline:
    """When each replica was closed to new work (``(replica index, t_closed, t_open)``, the
    baselines) or the pool's admitting fraction (``(t, fraction)``, sampled)."""

    closed: list[tuple[int, float, float]] = field(default_factory=list)
    admitting: list[tuple[float, float]] = field(default_factory=list)
    #: the pool's replica states, sampled: (t, state per replica index)
    states: list[tuple[float, list[str]]] = field(default_factory=list)
    #: per update: (step, t_push, t_all_on_new) (None while not known)
    updates: list[tuple[int, float, float | None]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------------------ baselines


class DirectTarget:
    """Requests straight to the replicas' ``/inference/v1/generate``. A sample goes to the
    replica with the fewest samples in flight and stays there. Its tokens' policies come from
    the ``weight_versions`` spans when ``spans`` (vLLM 0.32+), else from the markers
    (:func:`.workload.pieces_of_markers`, given :attr:`policy`, the newest policy loaded, which
    :func:`baseline_publish` advances)."""

    def __init__(self, urls: list[str], model: str, *, resubmit: bool, spans: bool) -> None:
        self.urls, self.model, self.resubmit, self.spans = urls, model, resubmit, spans
        self.busy = [0] * len(urls)
        self.policy = 0

    async def open(self, http: aiohttp.ClientSession, kind: str) -> int:
        i = min(range(len(self.urls)), key=lambda k: self.busy[k])
        self.busy[i] += 1
        return i

    async def close(self, http: aiohttp.ClientSession, ctx: Any) -> int | None:
        self.busy[int(ctx)] -= 1
        return None

    async def turn(
        self, http: aiohttp.ClientSession, ctx: Any, prompt: list[int], max_tokens: int
    ) -> TurnResult:
        url = self.urls[int(ctx)]
        res = TurnResult(pieces=[], replica=url)
        tokens, left = list(prompt), max_tokens
        while True:
            body = {
                "model": self.model,
                "token_ids": tokens,
                # output_kind 2 (FINAL_ONLY): every token in the answer; 0.32+ sets it on this
                # endpoint itself, 0.26 does not
                "sampling_params": {"max_tokens": left, "temperature": 1.0, "output_kind": 2},
            }
            async with http.post(url + "/inference/v1/generate", json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise ValueError(f"generate {r.status}: {str(data)[:120]}")
            choice = data["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            if self.spans:
                res.pieces += pieces_of_spans(ids, choice.get("weight_versions"))
            else:
                res.pieces += pieces_of_markers(ids, self.policy)
            left -= len(ids)
            if choice.get("finish_reason") != "abort" or not self.resubmit or left <= 0:
                return res
            tokens += ids  # AReaL/slime: resubmit prompt + partial output for the rest
            res.wasted_prefill += len(tokens)
            res.resubmits += 1


async def _all(engines: list[VllmEngine], what: str, **kw: Any) -> None:
    async def one(e: VllmEngine) -> None:
        if what == "reload":
            rpc = await e.collective_rpc(
                "reload_weights", {"weights_path": kw["path"]}, timeout_s=CONTROL_TIMEOUT_S
            )
            if any(isinstance(x, str) and "rror" in x for x in rpc.results):
                raise RuntimeError(f"reload_weights on {e.url}: {rpc.results}")
        elif what == "pause":
            await e.pause(kw["mode"], timeout_s=CONTROL_TIMEOUT_S)
        elif what == "reset":
            ev = await e.reset_caches(retries=20, timeout_s=CONTROL_TIMEOUT_S)
            if not ev.prefix:
                raise RuntimeError(f"prefix cache reset failed on {e.url}: {ev.detail}")
        elif what == "label":
            await e.set_label(kw["label"], timeout_s=CONTROL_TIMEOUT_S)
        elif what == "resume":
            await e.resume(timeout_s=CONTROL_TIMEOUT_S)

    await asyncio.gather(*(one(e) for e in engines))


def baseline_publish(
    strategy: str,
    engines: list[VllmEngine],
    load: Load,
    target: DirectTarget,
    timeline: Timeline,
    eos_prob: float,
) -> Any:
    """The ``publish(step)`` of a baseline: returns once every replica serves ``step``
    (``target.policy`` is ``step`` from the end of the reload on)."""

    async def publish(step: int) -> None:
        t0 = time.monotonic()
        path = str(await asyncio.to_thread(eos_marker, step, eos_prob))
        if strategy == "stop_the_world":
            load.gate.clear()
            try:
                await load.drained()
                await _all(engines, "pause", mode="wait")
                await _all(engines, "reload", path=path)
                target.policy = step
                await _all(engines, "reset")
                await _all(engines, "label", label=f"g{step}")
                await _all(engines, "resume")
            finally:
                load.gate.set()
        elif strategy == "keep":
            await _all(engines, "pause", mode="keep")
            await _all(engines, "reload", path=path)
            target.policy = step
            await _all(engines, "label", label=f"g{step}")
            await _all(engines, "resume")
        elif strategy == "abort_resubmit":
            await _all(engines, "pause", mode="abort")
            await _all(engines, "reload", path=path)
            target.policy = step
            await _all(engines, "reset")
            await _all(engines, "label", label=f"g{step}")
            await _all(engines, "resume")
        else:
            raise ValueError(f"not a baseline: {strategy}")
        t1 = time.monotonic()
        timeline.closed += [(i, t0, t1) for i in range(len(engines))]
        timeline.updates.append((step, t0, t1))

    return publish


async def prepare_replicas(engines: list[VllmEngine], eos_prob: float) -> None:
    """Every replica on policy 0 (``g0``), resumed, caches reset: the start of every segment.
    Abort anything left from the previous segment first."""
    for e in engines:
        if await e.is_paused(timeout_s=CONTROL_TIMEOUT_S):
            await e.resume(timeout_s=CONTROL_TIMEOUT_S)
    path = str(await asyncio.to_thread(eos_marker, 0, eos_prob))
    await _all(engines, "pause", mode="abort")
    await _all(engines, "reload", path=path)
    await _all(engines, "reset")
    await _all(engines, "label", label="g0")
    await _all(engines, "resume")


# ------------------------------------------------------------------------------ the pool


class PoolTarget:
    """Requests through the pool's router: singles on ``/v1/completions``, sessions opened with
    ``/v1/rollouts`` and carried by ``X-Rollout-Id``. As the pool's own clients do
    (``rolloutpool.integrations.trl``), a 503 is retried after 0.2 s: no admissible replica
    after the router's admission wait, or an answer withheld because the store could not
    confirm its binding (``store_unavailable``; a session's turn is sent again in the same
    session); a 429 ``session_busy`` after 20 ms. Both are counted."""

    def __init__(self, router_url: str) -> None:
        self.url = router_url
        self.retries_503 = 0
        self.retries_session_busy = 0

    async def open(self, http: aiohttp.ClientSession, kind: str) -> dict[str, Any]:
        ctx: dict[str, Any] = {"session": None, "generation": None}
        while kind == "session":
            async with http.post(self.url + "/v1/rollouts", json={}) as r:
                if r.status == 503:
                    self.retries_503 += 1
                    await asyncio.sleep(0.2)
                    continue
                data = await r.json(content_type=None)
                if r.status != 201:
                    raise ValueError(f"session open {r.status}: {str(data)[:120]}")
                ctx["session"], ctx["generation"] = data["rollout_id"], int(data["generation"])
                break
        return ctx

    async def turn(
        self, http: aiohttp.ClientSession, ctx: Any, prompt: list[int], max_tokens: int
    ) -> TurnResult:
        body = {
            "model": "rolloutpool",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "return_token_ids": True,
        }
        headers = {"X-Rollout-Id": ctx["session"]} if ctx["session"] else {}
        while True:
            async with http.post(self.url + "/v1/completions", json=body, headers=headers) as r:
                data = await r.json(content_type=None)
                if r.status == 503:
                    self.retries_503 += 1
                    await asyncio.sleep(0.2)
                    continue
                if r.status == 429 and str(data).find("session_busy") >= 0:
                    # the previous turn's answer arrived before the router freed the session's
                    # slot: retried (Retry-After is whole seconds; 20 ms is enough here)
                    self.retries_session_busy += 1
                    await asyncio.sleep(0.02)
                    continue
                if r.status != 200:
                    raise ValueError(f"completion {r.status}: {str(data)[:120]}")
            g = int(data["rollout"]["generation"])
            if ctx["generation"] is None:
                ctx["generation"] = g
            elif g != ctx["generation"]:
                raise ValueError(f"session moved from g{ctx['generation']} to g{g}")
            ids = tuple(int(t) for t in data["choices"][0]["token_ids"])
            return TurnResult([Piece(g, ids)], replica=str(data["rollout"].get("replica", "")))

    async def close(self, http: aiohttp.ClientSession, ctx: Any) -> int | None:
        if ctx["session"]:
            async with http.post(f"{self.url}/v1/rollouts/{ctx['session']}/close") as r:
                await r.read()
        g = ctx["generation"]
        return None if g is None else int(g)


@dataclass
class PoolStack:
    """Redis, one updater and one router in front of ``urls`` (already serving policy 0)."""

    urls: list[str]
    work: Path
    max_staleness: int
    max_unavailable: int
    first_wave: int
    eos_prob: float
    redis: RedisServer | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    router_url: str = ""
    updater_url: str = ""

    @property
    def settings(self) -> dict[str, Any]:
        n = len(self.urls)
        return {
            "max_staleness": self.max_staleness,
            "max_unavailable": self.max_unavailable,
            "first_wave": self.first_wave,
            "min_serving": max(0, n - self.max_unavailable),
            "drain_policy": "wait",
            "drain_timeout_s": 120.0,
            "transport": "reload",
            "routers": 1,
            "router_admission_wait_s": 15,
        }

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(self.work / "redis").start()
        base = await asyncio.to_thread(eos_marker, 0, self.eos_prob)
        s = self.settings
        up_port, port = free_port(), free_port()
        config = {
            "updater": {
                "port": up_port,
                "admin_token": ADMIN,
                "replicas": [
                    {"id": f"r{i:03d}", "url": u, "model": str(base), "capacity": 64}
                    for i, u in enumerate(self.urls)
                ],
                "max_unavailable": s["max_unavailable"],
                "first_wave": s["first_wave"],
                "min_serving": s["min_serving"],
                "max_staleness": s["max_staleness"],
                "drain_timeout_s": s["drain_timeout_s"],
                "health_interval_s": 2.0,
                "health_failures": 3,
            },
            "redis": {"url": self.redis.url, "namespace": "strategies"},
        }
        (self.work / "updater.yaml").write_text(yaml.safe_dump(config))
        self.procs.append(
            _spawn(
                [sys.executable, "-m", "updater", "--config", str(self.work / "updater.yaml")],
                self.work / "updater.log",
            )
        )
        env = {
            "ROLLOUTPOOL_ROUTER_PORT": str(port),
            "ROLLOUTPOOL_ROUTER_ADMISSION_WAIT_S": str(s["router_admission_wait_s"]),
            "ROLLOUTPOOL_ROUTER_MAX_STALENESS": str(self.max_staleness),
            "ROLLOUTPOOL_ROUTER_LOG_LEVEL": "WARNING",
            "ROLLOUTPOOL_REDIS_URL": self.redis.url,
            "ROLLOUTPOOL_REDIS_NAMESPACE": "strategies",
        }
        self.procs.append(_spawn([sys.executable, "-m", "router"], self.work / "router.log", env))
        self.router_url = f"http://127.0.0.1:{port}"
        self.updater_url = f"http://127.0.0.1:{up_port}"
        for url in (self.updater_url, self.router_url):
            await _wait_http(http, url + "/healthz", 300)
        await self._wait_ready(http)

    async def _wait_ready(self, http: aiohttp.ClientSession, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            view = await self.view(http)
            if view and sum(r["state"] == "READY" for r in view["replicas"]) == len(self.urls):
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the pool's replicas were not all READY within {timeout_s} s")

    async def view(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(self.updater_url + "/v1/pool", headers=headers) as r:
                if r.status == 200:
                    doc: dict[str, Any] = await r.json()
                    return doc
        return None

    async def sample_admitting(
        self, http: aiohttp.ClientSession, timeline: Timeline, stop: asyncio.Event, every_s: float
    ) -> None:
        """(t, fraction of replicas READY within ``max_staleness`` of the published generation)
        every ``every_s`` until ``stop``."""
        while not stop.is_set():
            view = await self.view(http)
            if view and view.get("latest"):
                g = int(view["latest"]["generation"])
                ok = sum(
                    1
                    for r in view["replicas"]
                    if r["state"] == "READY"
                    and r["generation"] is not None
                    and int(r["generation"]) >= g - self.max_staleness
                )
                now = time.monotonic()
                timeline.admitting.append((now, ok / len(self.urls)))
                states = [""] * len(self.urls)
                for r in view["replicas"]:
                    state = str(r["state"])
                    fresh = (
                        r["generation"] is not None
                        and int(r["generation"]) >= g - self.max_staleness
                    )
                    states[int(r["replica_id"][1:])] = (
                        state if fresh or state != "READY" else "READY_STALE"
                    )
                timeline.states.append((now, states))
            await asyncio.sleep(every_s)

    def publish(self, http: aiohttp.ClientSession, timeline: Timeline, tasks: list[Any]) -> Any:
        """``publish(step)``: push checkpoint ``step`` (returns at the 202) and follow its
        record in the background (``timeline.records``, ``timeline.updates``)."""

        async def publish(step: int) -> None:
            path = await asyncio.to_thread(eos_marker, step, self.eos_prob)
            t0 = time.monotonic()
            body = {
                "checkpoint": str(path),
                "step": step,
                "trainer_run": "strategies",
                "probe": {
                    "prompt_token_ids": PROBE_PROMPT,
                    "expected_token_ids": [policy_marker(step)] * 4,
                },
            }
            headers = {"Authorization": f"Bearer {ADMIN}"}
            async with http.post(self.updater_url + "/v1/updates", json=body, headers=headers) as r:
                rec = await r.json()
                if r.status != 202:
                    raise RuntimeError(f"push {step}: {r.status} {rec}")
            if int(rec.get("generation", step)) != step:
                raise RuntimeError(f"push {step} became generation {rec.get('generation')}")
            tasks.append(asyncio.create_task(self._follow(http, timeline, step, t0, rec["id"])))

        return publish

    async def _follow(
        self, http: aiohttp.ClientSession, timeline: Timeline, step: int, t0: float, uid: str
    ) -> None:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        rec: dict[str, Any] = {}
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(f"{self.updater_url}/v1/updates/{uid}", headers=headers) as r:
                    rec = await r.json()
            if rec.get("state") in ("succeeded", "failed", "superseded"):
                break
            await asyncio.sleep(0.1)
        t1 = time.monotonic()
        timeline.updates.append((step, t0, t1 if rec.get("state") == "succeeded" else None))
        timeline.records.append(rec)

    def stop(self) -> None:
        for p in reversed(self.procs):
            terminate(p)
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def logs(self) -> dict[str, str]:
        return {
            f.name: f.read_text(errors="replace")[-1500:] for f in sorted(self.work.glob("*.log"))
        }
