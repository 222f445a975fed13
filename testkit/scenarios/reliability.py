"""Reliability: replica crash and hang with rollouts in flight, Redis outages, API fuzzing.

    python -m bench.reliability [--fuzz-examples 25]

Setup: a local redis-server with an ACL user and password (the pool connects as that user), 2
vLLM CPU replicas on marker checkpoints launched by an in-process updater, the router as a
separate process. Sections (merged into ``bench/results/reliability.json``; ``bench.soak``
writes the ``soak`` section):

* ``replica_crash``: sessions pinned to r1 have long generations in flight; r1 is SIGKILLed.
  Measured: how long until the store stops admitting to it, what the clients got (a 5xx JSON
  error, never a hang), the bindings' final state and reason, and the time until r1 is back
  READY on the latest generation.
* ``replica_hang``: the same with SIGSTOP: only the health deadline can notice it.
* ``redis_outage``: Redis restarted, and separately stopped for 10 s, under load. The router
  goes on admitting one-request rollouts under the capacity grants it holds, and delivers
  their answers, only while its last heartbeat is under ``failover_grace_s / 2`` old (no weight
  can change before its grants lapse); past that it must refuse (503):
  ``admitted_past_bound`` counts answers delivered later than that bound after Redis went
  away, and must be 0 (``admissions_during`` counts all of them). An update pushed meanwhile
  must not start; bindings recorded before the restart must still be there after it (AOF);
  afterwards the pool serves and updates again by itself.
* ``fuzz``: schemathesis against the updater's and the router's ``/openapi.json`` (loopback,
  bounded examples): server errors other than documented ones, and bindings leaked afterwards.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from pool.errors import NotFound, StoreUnavailable
from pool.launcher import ReplicaSpec
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import ReplicaState
from pool.web import start_server
from rolloutpool.local.models import marker_token
from testkit.harness import local_launcher
from testkit.procs import terminate
from testkit.redis_server import RedisServer, free_port
from testkit.scenarios.rolling import NAMESPACE, PROBE_PROMPT, marker, push, start_router, wait_http
from updater.api import ProbeSpec, UpdateRequest
from updater.app import create_api
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

S = ReplicaState
FAILOVER_GRACE_S = 10.0  # the router's: it delivers under its grants for half this unheartbeated
USER, PASSWORD, ADMIN = "rolloutpool", "s3cret-redis-pass", "reliability-admin"
#: The replicas' context and the length of the rollouts a replica fault must catch in flight.
#: The fault lands once a sentinel sent after them has delivered a token to this process; on a
#: saturated host vLLM's API server delivers seconds late while its engine goes on (measured: up
#: to 5.5 s), and 480-token rollouts (the most a 512-token context allows) had then already
#: ended. 4000 tokens run for ~13 s on an idle host.
CONTEXT, LONG = 4096, 4000
ADMISSION_WAIT_S = 2.0
#: The fuzzed router's request deadline. A fuzzed completion may ask for up to ``CONTEXT``
#: tokens, which a loaded host generates in well over a minute; the deadline ends it with a
#: documented 504 instead, so every answer comes within ``FUZZ_DEADLINE_S + ADMISSION_WAIT_S``
#: and schemathesis's request timeout (twice that) never depends on the host's speed.
FUZZ_DEADLINE_S = 10.0
FUZZ_REQUEST_TIMEOUT_S = 2 * (FUZZ_DEADLINE_S + ADMISSION_WAIT_S)


@dataclass
class Env:
    workdir: Path
    redis: RedisServer
    store: RedisStore
    updater: Updater
    router_url: str
    updater_url: str
    router: subprocess.Popen[bytes]
    updater_runner: web.AppRunner


def redis_server(workdir: Path, port: int = 0) -> RedisServer:
    return RedisServer(workdir / "redis", port=port, username=USER, password=PASSWORD)


async def start_env(workdir: Path) -> Env:
    for g in range(6):
        await asyncio.to_thread(marker, g)
    redis = await asyncio.to_thread(redis_server(workdir).start)
    ss = StoreSettings(
        url=redis.url, namespace=NAMESPACE, username=USER, password=PASSWORD, socket_timeout_s=1.0
    )
    store = RedisStore.connect(ss)
    base = marker(0)
    replicas = [
        ReplicaConfig(
            id=f"r{i}",
            model=base,
            launch=ReplicaSpec(
                model=base,
                name=f"rel-r{i}",
                cpu_bind=str(i),
                work_dir=workdir / f"r{i}",
                max_model_len=CONTEXT,
            ),
        )
        for i in range(2)
    ]
    settings = UpdaterSettings(
        replicas=replicas,
        admin_token=ADMIN,
        health_interval_s=0.5,
        health_timeout_s=1.0,
        health_failures=2,
    )
    up = Updater(settings, store)
    await up.start()
    runner, uport = await start_server(create_api(up, settings))
    router, url = await router_process(redis.url)
    return Env(workdir, redis, store, up, url, f"http://127.0.0.1:{uport}", router, runner)


async def router_process(
    redis_url: str, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """A router process on this pool's Redis (as its ACL user), answering ``/healthz``."""
    port = free_port()
    router = start_router(
        port,
        redis_url,
        3.0,
        {
            "ROLLOUTPOOL_REDIS_USERNAME": USER,
            "ROLLOUTPOOL_REDIS_PASSWORD": PASSWORD,
            "ROLLOUTPOOL_REDIS_SOCKET_TIMEOUT_S": "1.0",
            "ROLLOUTPOOL_REDIS_FAILOVER_GRACE_S": str(FAILOVER_GRACE_S),
            "ROLLOUTPOOL_ROUTER_ADMISSION_WAIT_S": str(ADMISSION_WAIT_S),
            "ROLLOUTPOOL_ROUTER_ADMIN_TOKEN": ADMIN,
            **(extra_env or {}),
        },
    )
    url = f"http://127.0.0.1:{port}"
    await wait_http(url + "/healthz")
    return router, url


async def stop_env(env: Env) -> None:
    terminate(env.router, grace_s=20)
    await env.updater_runner.cleanup()
    await env.updater.stop()
    await env.store.close()
    env.redis.stop()


# ------------------------------------------------------------------ replica faults


async def _pinned_sessions(env: Env, http: httpx.AsyncClient, rid: str, n: int) -> list[str]:
    ids: list[str] = []
    for _ in range(40):
        r = await http.post("/v1/rollouts", json={})
        s = r.json()
        if s["replica"] == rid:
            ids.append(s["rollout_id"])
        else:
            await http.post(f"/v1/rollouts/{s['rollout_id']}/close")
        if len(ids) == n:
            break
    return ids


async def _sentinel(url: str, model: str | None, first_token: asyncio.Event) -> None:
    """Stream one long rollout from ``url``; set ``first_token`` when a token arrives. Ends
    (quietly) when the stream does, e.g. when the replica is killed."""
    body = {
        "model": model,
        "prompt": [9, 8, 7],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with (
            httpx.AsyncClient(timeout=600) as http,
            http.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    first_token.set()
    except httpx.HTTPError:
        pass


def _answer(call: asyncio.Task[httpx.Response]) -> str:
    """What an ended rollout call got: status and error code, or the exception."""
    if call.cancelled():
        return "cancelled"
    exc = call.exception()
    if exc is not None:
        return type(exc).__name__
    r = call.result()
    try:
        code = r.json().get("error", {}).get("code")
    except ValueError:
        code = None
    return f"{r.status_code} {code or ''}".strip()


async def watch_recovery(
    store: RedisStore, replica_id: str, t0: float, *, timeout_s: float, poll_s: float = 0.05
) -> tuple[float | None, float | None]:
    """After a fault at monotonic ``t0``: seconds until the replica left READY (detected) and
    until it was READY again (recovered); None for what did not happen within ``timeout_s``."""
    detected = recovered = None
    while time.monotonic() - t0 < timeout_s:
        state = (await store.replica(replica_id)).state
        if detected is None and state is not S.READY:
            detected = time.monotonic() - t0
        if detected is not None and state is S.READY:
            recovered = time.monotonic() - t0
            break
        await asyncio.sleep(poll_s)
    return detected, recovered


#: Tries at catching the rollouts in flight (see :func:`replica_fault`).
FAULT_TRIES = 3


async def replica_fault(env: Env, sig: signal.Signals, n: int = 2) -> dict[str, Any]:
    """Send ``sig`` to r1's process group while ``n`` session rollouts pinned to it are
    generating; what each of them got and what its binding says. A try in which one of them
    had already ended when the fault was due (e.g. a 503 while a starved host left Redis
    unanswered past the socket timeout) cannot show what the fault does to it: its rollouts
    are cancelled, and the fault waits for another try (``discarded_tries`` says why)."""
    m = env.updater.replicas["r1"]
    launcher = local_launcher(env.updater, "r1")
    assert launcher.pid is not None
    body = {
        "model": "rolloutpool",
        "prompt": [5, 6, 7],
        "max_tokens": LONG,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    discarded: list[dict[str, Any]] = []
    done_at: dict[str, float] = {}  # when each rollout's call ended, by id (unique across tries)
    async with httpx.AsyncClient(base_url=env.router_url, timeout=90) as http:
        for _ in range(FAULT_TRIES):
            ids = await _pinned_sessions(env, http, "r1", n)

            async def call(rollout_id: str) -> httpx.Response:
                try:
                    return await http.post(
                        "/v1/completions", json=body, headers={"X-Rollout-Id": rollout_id}
                    )
                finally:
                    done_at[rollout_id] = time.monotonic()

            calls = [asyncio.create_task(call(i)) for i in ids]
            # Fault once a sentinel rollout sent straight to the replica after them has
            # streamed its first token: the rollouts under test are then generating, far from
            # their last token. (A fixed sleep raced; so did polling /metrics, which vLLM
            # answers late while busy.)
            sentinel = asyncio.Event()
            drain = asyncio.create_task(
                _sentinel(m.handle.engine.url, m.handle.engine.model_id, sentinel)
            )
            await asyncio.wait_for(sentinel.wait(), timeout=60)
            ended = [(i, c) for i, c in zip(ids, calls, strict=True) if c.done()]
            if not ended:
                break
            discarded.append({i: _answer(c) for i, c in ended})
            for c in calls:
                c.cancel()
            drain.cancel()
            await asyncio.gather(*calls, drain, return_exceptions=True)
            for i in ids:
                await http.post(f"/v1/rollouts/{i}/close")
        else:
            raise RuntimeError(f"no try caught the rollouts in flight: {discarded}")
        t0 = time.monotonic()
        os.killpg(launcher.pid, sig)
        detected, recovered = await watch_recovery(env.store, "r1", t0, timeout_s=300)
        results = await asyncio.gather(*calls, return_exceptions=True)
        drain.cancel()
    outcomes: list[dict[str, Any]] = []
    for rid, res in zip(ids, results, strict=True):
        b = await env.store.binding(rid)
        before = done_at[rid] < t0
        if isinstance(res, BaseException):
            outcomes.append(
                {
                    "client": type(res).__name__,
                    "binding": b.state.value,
                    "reason": b.reason,
                    "ended_before_fault": before,
                }
            )
            continue
        try:
            code = res.json().get("error", {}).get("code")
        except ValueError:
            code = None
        outcomes.append(
            {
                "client": res.status_code,
                "error_code": code,
                "binding": b.state.value,
                "reason": b.reason,
                "ended_before_fault": before,
            }
        )
    aborted = sum(
        1
        for o in outcomes
        if isinstance(o["client"], int)
        and o["client"] >= 500
        and o["error_code"]
        and o["binding"] == "aborted"
        and o["reason"]
        and not o["ended_before_fault"]
    )
    # A session's binding outlives its requests: one that answered 200 before the fault is
    # aborted later by the taint, which is right (its output was delivered while it was valid).
    finished = sum(1 for o in outcomes if o["client"] == 200 and o["ended_before_fault"])
    latest = await env.store.latest()
    rec = await env.store.replica("r1")
    return {
        "signal": sig.name,
        "detected_after_s": None if detected is None else round(detected, 3),
        "inflight": len(ids),
        "inflight_aborted": aborted,
        "inflight_finished_before_fault": finished,
        "inflight_lost": len(ids) - aborted - finished,
        "recovered": recovered is not None
        and latest is not None
        and rec.generation == latest[0].number,
        "recovered_after_s": None if recovered is None else round(recovered, 1),
        "outcomes": outcomes,
        "discarded_tries": discarded,
        "health": {
            "interval_s": env.updater.settings.health_interval_s,
            "timeout_s": env.updater.settings.health_timeout_s,
            "failures": env.updater.settings.health_failures,
        },
    }


# ------------------------------------------------------------------ redis outages


async def _load(env: Env, log: list[tuple[float, float, int, str]], stop: asyncio.Event) -> None:
    body = {
        "model": "rolloutpool",
        "prompt": [9, 8, 7],
        "max_tokens": 8,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=env.router_url, timeout=30) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = await http.post("/v1/completions", json=body)
                rid = r.headers.get("X-Rollout-Id", "")
                code = r.status_code
                if code != 200:
                    rid = r.json().get("error", {}).get("code", "")
            except httpx.HTTPError as e:
                code, rid = 0, type(e).__name__
            log.append((t0, time.monotonic(), code, rid))
            if code != 200:
                await asyncio.sleep(0.05)


async def _outage(
    env: Env, down_s: float, log: list[tuple[float, float, int, str]]
) -> dict[str, Any]:
    before = [rid for _, _, code, rid in log if code == 200]
    port = env.redis.port
    t_stop = time.monotonic()
    await asyncio.to_thread(env.redis.stop)
    t_down = time.monotonic()  # the process has exited: nothing can be admitted from here on
    await asyncio.sleep(0.5)
    push_during: str
    try:
        await env.updater.submit(
            UpdateRequest(
                checkpoint=str(marker(5)),
                step=5,
                probe=ProbeSpec(
                    prompt_token_ids=PROBE_PROMPT, expected_token_ids=[marker_token(5)] * 4
                ),
            )
        )
        push_during = "accepted"
    except StoreUnavailable:
        push_during = "refused: store_unavailable"
    await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t_stop)))
    t_up = time.monotonic()
    env.redis = await asyncio.to_thread(redis_server(env.workdir, port).start)
    during = [x for x in log if x[0] > t_down + 0.05 and x[1] < t_up]
    admitted = [x for x in during if x[2] == 200]
    # the router's last heartbeat was before t_down: it may deliver under its grants until then
    past_bound = [x for x in admitted if x[1] > t_down + FAILOVER_GRACE_S / 2]
    lost = 0
    for rid in before[-200:]:
        for _ in range(50):
            try:
                await env.store.binding(rid)
                break
            except NotFound:
                lost += 1
                break
            except StoreUnavailable:  # reconnecting
                await asyncio.sleep(0.1)
    t_back = None
    while time.monotonic() - t_up < 60:
        if any(x[0] > t_up and x[2] == 200 for x in log):
            t_back = time.monotonic() - t_up
            break
        await asyncio.sleep(0.1)
    return {
        "down_s": round(t_up - t_down, 1),
        "requests_during": len(during),
        "admissions_during": len(admitted),
        "admitted_past_bound": len(past_bound),
        "refusals_during": sorted({x[3] for x in during if x[2] != 200}),
        "update_push_during": push_during,
        "bindings_checked": min(200, len(before)),
        "bindings_lost_after_restart": lost,
        "resumed": t_back is not None,
        "resumed_after_s": None if t_back is None else round(t_back, 2),
    }


async def redis_outage(env: Env) -> dict[str, Any]:
    log: list[tuple[float, float, int, str]] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_load(env, log, stop)) for _ in range(3)]
    await asyncio.sleep(3)
    restart = await _outage(env, 1.0, log)
    await asyncio.sleep(3)
    stopped = await _outage(env, 10.0, log)
    await asyncio.sleep(3)
    stop.set()
    await asyncio.gather(*tasks)
    rec = await push(env.updater, 4)  # the pool updates again by itself
    return {
        "restart": restart,
        "stopped_10s": stopped,
        "admissions_during": restart["admissions_during"] + stopped["admissions_during"],
        "admitted_past_bound": restart["admitted_past_bound"] + stopped["admitted_past_bound"],
        "bound_s": FAILOVER_GRACE_S / 2,
        "bindings_lost_after_restart": (
            restart["bindings_lost_after_restart"] + stopped["bindings_lost_after_restart"]
        ),
        "resumed": restart["resumed"] and stopped["resumed"] and rec["state"] == "succeeded",
        "update_after": rec["state"],
        "update_after_error": rec["error"],
        "update_after_replicas": {
            rid: f"{r['outcome']}: {r['reason']}" for rid, r in rec["replicas"].items()
        },
        "durability": "appendonly yes, appendfsync everysec: a clean restart loses nothing; a "
        "crash can lose up to ~1 s of writes",
        "auth": f"ACL user {USER!r} with a password (the default user has a random "
        "password nobody is given)",
    }


# ------------------------------------------------------------------ fuzzing


def schemathesis_run(
    schema_url: str, base_url: str, examples: int, headers: dict[str, str]
) -> dict[str, Any]:
    """One schemathesis run; ``tail`` holds its errors and failures when it has any (else the
    end of its output)."""
    argv = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        schema_url,
        "--url",
        base_url,
        # every status must be documented (502/503/504 are; a 500 never is)
        "--checks",
        "status_code_conformance",
        "-n",
        str(examples),
        "--no-color",
        "--request-timeout",
        str(FUZZ_REQUEST_TIMEOUT_S),
        "--phases",
        "examples,coverage,fuzzing",
        "--suppress-health-check",
        "all",
    ]
    for k, v in headers.items():
        argv += ["-H", f"{k}: {v}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    cases = sum(int(n) for n in re.findall(r"(\d+) generated", text)) or None
    m = re.search(r"Test cases:\s*\n?\s*(\d+) generated", text)
    if m:
        cases = int(m.group(1))
    m = re.search(r"(\d+) unique failures?", text)
    failures = int(m.group(1)) if m else (0 if out.returncode == 0 else -1)
    return {
        "exit_code": out.returncode,
        "cases": cases,
        "undocumented_status": failures,
        "server_errors_500": len(re.findall(r"\b500 Internal Server Error", text)),
        "tail": _problems(text) or text[-1500:],
    }


async def _active_after(store: RedisStore, *, timeout_s: float) -> int:
    """Bindings still counted on the replicas once they reach 0, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (active := sum(r.active for r in await store.replicas())) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.2)
    return active


def _problems(text: str) -> str:
    """schemathesis's ERRORS and FAILURES sections, up to the next section."""
    found = re.findall(r"^=+ (?:ERRORS|FAILURES) =+$.*?(?=^=+ [A-Z]+ =+$)", text, re.M | re.S)
    return "".join(found)[:6000]


async def fuzz(env: Env, examples: int) -> dict[str, Any]:
    """The updater's API, then the router's through a router of its own whose request deadline
    bounds every answer (``FUZZ_DEADLINE_S``); then every binding the fuzz opened must end: an
    open session's lease (6 s) lapses and the reaper aborts it."""
    up = await asyncio.to_thread(
        schemathesis_run,
        env.updater_url + "/openapi.json",
        env.updater_url,
        examples,
        {"Authorization": f"Bearer {ADMIN}"},
    )
    router, url = await router_process(
        env.redis.url, {"ROLLOUTPOOL_ROUTER_REQUEST_DEADLINE_S": str(FUZZ_DEADLINE_S)}
    )
    try:
        rt = await asyncio.to_thread(schemathesis_run, url + "/openapi.json", url, examples, {})
    finally:
        terminate(router, grace_s=20)
    leaked = await _active_after(env.store, timeout_s=60)
    return {
        "updater_cases": up["cases"],
        "router_cases": rt["cases"],
        "check": "status_code_conformance: every response status is documented (the "
        "documented 5xx are 502/503/504; a 500 never is)",
        "server_errors": up["undocumented_status"] + rt["undocumented_status"],
        "updater_exit_code": up["exit_code"],
        "router_exit_code": rt["exit_code"],
        "leaked_bindings": leaked,
        "updater_tail": up["tail"],
        "router_tail": rt["tail"],
    }


async def scenario(
    workdir: Path,
    *,
    fuzz_examples: int = 25,
    faults: bool = True,
    outage: bool = True,
    fuzzing: bool = True,
) -> dict[str, Any]:
    env = await start_env(workdir)
    out: dict[str, Any] = {}
    try:
        if faults:
            out["replica_crash"] = await replica_fault(env, signal.SIGKILL)
            print("crash:", out["replica_crash"], flush=True)
            out["replica_hang"] = await replica_fault(env, signal.SIGSTOP)
            print("hang:", out["replica_hang"], flush=True)
        if outage:
            out["redis_outage"] = await redis_outage(env)
            print(
                "redis:",
                {
                    k: v
                    for k, v in out["redis_outage"].items()
                    if k not in ("restart", "stopped_10s")
                },
                flush=True,
            )
        if fuzzing:
            out["fuzz"] = await fuzz(env, fuzz_examples)
            print("fuzz:", {k: v for k, v in out["fuzz"].items() if "tail" not in k}, flush=True)
        return out
    finally:
        await stop_env(env)
