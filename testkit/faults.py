"""The fault rig: the pool's own control plane killed, stopped and raced, checked like Jepsen.

:class:`Rig` runs a real ``redis-server`` (AOF), a router process and any number of updater
processes (``python -m updater --config``, the ``local`` provider launching real vLLM CPU replicas
of marker checkpoints: generation g emits only :func:`~rolloutpool.local.models.marker_token`
``(g)``). While a cell's fault plays out (:meth:`Rig.signal` on an updater's pid, at the moment
:meth:`Rig.wait_phase` sees a replica enter a phase), it keeps:

* **clients** (:meth:`Rig.load`): closed-loop completions through the router at temperature 1;
  every answer that claims generation g must hold only g's marker (``cross_generation``);
* a **sampler** of the replica records every few ms: a record READY at a URL together with the
  process identity validated at another one is a server admitted on nobody's validation
  (``unvalidated_ready``).

:meth:`Rig.verdict` then checks the history: every fencing token in the journal, in stream
order, is at least every earlier one (a write with a stale token after a takeover breaks it:
``stale_token_writes``); no binding left active; no replica process left that no live updater
owns (``orphaned_processes``: processes whose working directory is under the rig's, once
every updater is gone); no update record left ``running`` (``records_left_running``).

Used by ``tests/integration/test_updater_faults.py`` (a fixed sample) and ``bench/faults.py``
(every cell, ``bench/results/faults.json``). Not thread-safe; one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from pool.errors import StoreError
from pool.evidence import ProcessIdentity
from pool.launcher import free_port
from pool.store import RedisStore
from pool.types import ReplicaRecord, ReplicaState
from rolloutpool.local.models import ensure_model, marker_token
from testkit.fault_redis import RedisKind, RigRedis, SentinelRedis, StandaloneRedis
from testkit.procs import terminate
from testkit.scenarios.rolling import NAMESPACE, start_router, wait_http
from updater.providers.leash import runs, start_ticks

S = ReplicaState
ADMIN = "fault-rig-admin-token"
PROBE_PROMPT = list(range(10, 26))
HOLDING_ROUTER = "fault-matrix-holds-the-epoch-gate"


def marker(g: int) -> Path:
    return ensure_model("marker", token_id=marker_token(g))


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def _answering(urls: list[str]) -> bool:
    async with httpx.AsyncClient(timeout=2) as c:
        try:
            answers = await asyncio.gather(*(c.get(u + "/health") for u in urls))
        except httpx.HTTPError:
            return False
    return all(r.status_code == 200 for r in answers)


@dataclass
class UpdaterProc:
    """One updater process of the rig."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@dataclass
class History:
    """What the clients and the sampler saw."""

    answers: int = 0
    cross_generation: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    unvalidated_ready: list[str] = field(default_factory=list)
    #: (url, process) pairs seen READY, by the process identity recorded with them
    validated: dict[str, str] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class Rig:
    """See the module docstring. ``async with Rig(workdir) as rig:``."""

    def __init__(
        self,
        workdir: Path,
        *,
        replicas: int = 1,
        lease_s: float = 3.0,
        startup_timeout_s: float = 600.0,
        backend: Literal["vllm", "standin"] = "vllm",
        request_tps: float = 100.0,
        redis: RedisKind = "standalone",
        first_wave: int = 1,
    ) -> None:
        self.workdir = workdir.resolve()
        self.replicas = replicas
        #: the updaters' ``first_wave`` (and ``max_unavailable``, with ``min_serving`` 0, when
        #: above 1: that many replicas update together before the generation is published)
        self.first_wave = first_wave
        self.backend = backend
        self.request_tps = request_tps
        self._fleet: subprocess.Popen[bytes] | None = None
        self.fleet_urls: list[str] = []
        self.fleet_admin = ""
        self._restarted: set[tuple[str, int]] = set()
        self.lease_s = lease_s
        self.startup_timeout_s = startup_timeout_s
        self.updaters: list[UpdaterProc] = []
        self.history = History()
        self.redis: RigRedis = (
            SentinelRedis(self.workdir) if redis == "sentinel" else StandaloneRedis(self.workdir)
        )
        self._router: subprocess.Popen[bytes] | None = None
        self.router_url = ""
        self._store: RedisStore | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    @property
    def store(self) -> RedisStore:
        assert self._store is not None, "the rig is not started"
        return self._store

    async def __aenter__(self) -> Rig:
        await asyncio.to_thread(marker, 0)
        await asyncio.to_thread(self.redis.start)
        self._store = RedisStore.connect(self.redis.settings(NAMESPACE))
        self.router_port = free_port()
        await self.start_router()
        if self.backend == "standin":
            await self._start_fleet()
            self._tasks.append(asyncio.create_task(self._orchestrate(), name="orchestrator"))
        self._tasks.append(asyncio.create_task(self._sample(), name="sampler"))
        return self

    async def start_router(self) -> None:
        """(Re)start the router process, always on the rig's router port."""
        env = self.redis.router_env()
        self._router = start_router(self.router_port, self.redis.url, self.lease_s, env)
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        await wait_http(self.router_url + "/healthz")

    @property
    def router(self) -> subprocess.Popen[bytes]:
        assert self._router is not None
        return self._router

    async def _start_fleet(self) -> None:
        """The stand-in replicas: one ``python -m testkit.standin`` process, run by the rig
        as their orchestrator would (the updater's ``external`` provider reaches them by URL,
        and :meth:`_orchestrate` restarts the ones it waits for)."""
        urls = self.workdir / "standins.json"
        argv = [sys.executable, "-m", "testkit.standin", "--count", str(self.replicas)]
        argv += ["--admin-port", "0", "--urls-file", str(urls), "--model", str(marker(0))]
        argv += ["--request-tps", str(self.request_tps), "--served-model-name", "rolloutpool"]
        self._fleet = _spawn(argv, self.workdir / "standins.log")
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(urls.exists):
            if time.monotonic() > deadline or self._fleet.poll() is not None:
                raise RuntimeError("the stand-in fleet did not start")
            await asyncio.sleep(0.05)
        doc = json.loads(await asyncio.to_thread(urls.read_text))
        self.fleet_urls, self.fleet_admin = list(doc["urls"]), str(doc["admin"])

    async def fleet(
        self, action: str, replica: int | str, body: dict[str, Any] | None = None
    ) -> None:
        """A stand-in fleet admin action (``faults``, ``time``, ``die``, ``restart``)."""
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"{self.fleet_admin}/replicas/{replica}/{action}", json=body or {})
            r.raise_for_status()

    async def _orchestrate(self) -> None:
        """Restart a stand-in the updater waits for (TAINTED, waiting for a new process), once
        per taint, as Kubernetes restarts a deleted pod."""
        while not self._stop.is_set():
            with contextlib.suppress(StoreError, httpx.HTTPError):
                for rec in await self.store.replicas():
                    key = (rec.replica_id, rec.updated_ms)
                    if rec.state is S.TAINTED and "waiting for a new server process" in rec.reason:
                        if key not in self._restarted:
                            self._restarted.add(key)
                            await self.fleet("restart", int(rec.replica_id[1:]))
            await asyncio.sleep(0.1)

    def process_of(self, rec: ReplicaRecord) -> tuple[int, int] | None:
        """The (pid, start ticks) a local replica's record names, if any."""
        ident = ProcessIdentity.decode(rec.process)
        if ident is None or ident.provider is None or not ident.provider.startswith("pid:"):
            return None
        pid, _, rest = ident.provider[4:].partition("@")
        started = rest.partition("@")[0]
        return int(pid), int(started)

    async def wait_gone(self, process: tuple[int, int], timeout_s: float = 30.0) -> float:
        """Seconds until the process (pid, start ticks) has exited (TimeoutError past
        ``timeout_s``)."""
        t0 = time.monotonic()
        while runs(*process):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"process {process[0]} still runs after {timeout_s:g} s")
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._tasks:
            with contextlib.suppress(Exception):
                await t
        for up in self.updaters:
            up.proc.send_signal(signal.SIGCONT)
            await asyncio.to_thread(terminate, up.proc, 60.0)
        if self._router is not None:
            await asyncio.to_thread(terminate, self._router)
        if self._fleet is not None:
            await asyncio.to_thread(terminate, self._fleet)
        if self._store is not None:
            await self._store.close()
        await asyncio.to_thread(self.redis.stop)

    # ------------------------------------------------------------------ updaters

    def _config(self, name: str) -> tuple[Path, int]:
        base = marker(0)
        replicas: list[dict[str, Any]] = [
            {"id": f"r{i}", "model": str(base), "url": url} for i, url in enumerate(self.fleet_urls)
        ]
        if self.backend == "vllm":
            replicas = [
                {
                    "id": f"r{i}",
                    "model": str(base),
                    "launch": {
                        "model": str(base),
                        "name": f"{name}-r{i}",
                        "cpu_bind": str(i % max(1, os.cpu_count() or 1)),
                        "work_dir": str(self.workdir / name / f"r{i}"),
                        "startup_timeout_s": self.startup_timeout_s,
                        "startup_max_s": max(900.0, self.startup_timeout_s),
                    },
                }
                for i in range(self.replicas)
            ]
        n = self.first_wave
        wave = {"first_wave": n, "max_unavailable": n, "min_serving": 0} if n > 1 else {}
        port = free_port()
        cfg = {
            "updater": {
                "port": port,
                "admin_token": ADMIN,
                "replicas": replicas,
                "provider": "local" if self.backend == "vllm" else "external",
                "health_interval_s": 0.5,
                "health_failures": 3,
                **wave,
            },
            "redis": {
                **self.redis.updater_config(),
                "namespace": NAMESPACE,
                "updater_lease_s": self.lease_s,
            },
        }
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path, port

    async def start_updater(self, name: str, *, wait: bool = True) -> UpdaterProc:
        """Start an updater process; with ``wait``, return once it holds the lease and has
        joined its replicas (``/healthz`` 200)."""
        path, port = self._config(name)
        argv = [sys.executable, "-m", "updater", "--config", str(path)]
        proc = _spawn(argv, self.workdir / f"{name}.log")
        up = UpdaterProc(name, proc, f"http://127.0.0.1:{port}")
        self.updaters.append(up)
        if wait:
            await self.wait_ready(up)
        return up

    async def wait_ready(self, up: UpdaterProc, timeout_s: float | None = None) -> None:
        limit = timeout_s if timeout_s is not None else self.startup_timeout_s + 120
        deadline = time.monotonic() + limit
        async with httpx.AsyncClient() as c:
            while time.monotonic() < deadline:
                if not up.running:
                    raise RuntimeError(f"updater {up.name} exited ({up.proc.returncode})")
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(up.url + "/healthz", timeout=2)).status_code == 200:
                        return
                await asyncio.sleep(0.2)
        raise TimeoutError(f"updater {up.name} not ready after {limit:g} s")

    def signal(self, up: UpdaterProc, sig: signal.Signals) -> None:
        """Signal the updater's process (not its replicas: they run in groups of their own)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(up.proc.pid, sig)

    async def wait_exit(self, up: UpdaterProc, timeout_s: float = 60.0) -> int:
        code = await asyncio.to_thread(up.proc.wait, timeout_s)
        return int(code)

    async def push(self, up: UpdaterProc, g: int, *, wait: bool = True) -> dict[str, Any]:
        """Push marker checkpoint ``g``; with ``wait``, return its final record."""
        path = await asyncio.to_thread(marker, g)
        body = {
            "checkpoint": str(path),
            "step": g,
            "trainer_run": "faults",
            "probe": {
                "prompt_token_ids": PROBE_PROMPT,
                "expected_token_ids": [marker_token(g)] * 4,
            },
        }
        headers = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(base_url=up.url, headers=headers, timeout=30) as c:
            deadline = time.monotonic() + 60
            while True:  # 503: Redis away for a moment (fails closed); a trainer retries
                r = await c.post("/v1/updates", json=body)
                if r.status_code != 503 or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.2)
            r.raise_for_status()
            rec: dict[str, Any] = r.json()
            while wait and rec["state"] in ("queued", "running"):
                await asyncio.sleep(0.1)
                rec = (await c.get(f"/v1/updates/{rec['id']}")).json()
        return rec

    # ------------------------------------------------------------------ watching

    async def wait_phase(
        self,
        replica_id: str,
        phase: S,
        timeout_s: float = 300.0,
        past: int | None = None,
    ) -> float:
        """Return as soon as the replica's record is in ``phase`` (polled every ~2 ms).
        TimeoutError past ``timeout_s``, or at once when the record is READY on generation
        ``past`` or later (the phase was missed: the update went through it between polls)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                rec = await self.store.replica(replica_id)
                if rec.state is phase:
                    return time.monotonic()
                if past is not None and rec.state is S.READY and (rec.generation or 0) >= past:
                    break
            await asyncio.sleep(0.002)
        raise TimeoutError(f"{replica_id} did not enter {phase} (missed or not reached)")

    async def converged(self, timeout_s: float) -> float:
        """Seconds until every replica is READY on the latest generation and answers
        ``/health`` (a record can say READY of a server that just died; TimeoutError past
        ``timeout_s``)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with contextlib.suppress(StoreError):
                latest = await self.store.latest()
                recs = await self.store.replicas()
                if (
                    latest is not None
                    and len(recs) == self.replicas
                    and all(r.state is S.READY and r.generation == latest[0].number for r in recs)
                    and await _answering([r.url for r in recs])
                ):
                    return time.monotonic() - t0
            await asyncio.sleep(0.05)
        raise TimeoutError(f"not converged within {timeout_s:g} s")

    async def _sample(self) -> None:
        h = self.history
        while not self._stop.is_set():
            try:
                recs = await self.store.replicas()
            except StoreError:
                await asyncio.sleep(0.05)
                continue
            h.samples += 1
            for rec in recs:
                self._check_ready(rec)
            await asyncio.sleep(0.005)

    def _check_ready(self, rec: ReplicaRecord) -> None:
        """A READY record's process identity must be the one validated at its URL: the first
        READY sighting of an identity binds it to its URL."""
        if rec.state is not S.READY or not rec.process:
            return
        url = self.history.validated.setdefault(rec.process, rec.url)
        if url != rec.url:
            self.history.unvalidated_ready.append(
                f"{rec.replica_id} READY at {rec.url} with the process validated at {url}"
            )

    def load(self, clients: int = 2, max_tokens: int = 24) -> None:
        """Start ``clients`` closed-loop clients through the router (until the rig ends)."""
        for seed in range(clients):
            self._tasks.append(asyncio.create_task(self._client(seed, max_tokens)))

    async def probe(self, n: int = 20) -> int:
        """``n`` short completions through the router, right after a cell converged, checked
        like the clients' (a replica READY on a process nobody validated shows up here, before
        the next update replaces its weights); returns how many were answered."""
        answered = 0
        async with httpx.AsyncClient(base_url=self.router_url, timeout=30) as http:
            for i in range(n):
                body = {
                    "model": "rolloutpool",
                    "prompt": [3, 4, 5 + i],
                    "max_tokens": 4,
                    "return_token_ids": True,
                    "ignore_eos": True,
                }
                try:
                    r = await http.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    self.history.error(f"probe {type(e).__name__}")
                    continue
                if r.status_code == 200:
                    answered += 1
                    self._check_answer(r.json())
        return answered

    def _check_answer(self, data: dict[str, Any]) -> None:
        g = int(data["rollout"]["generation"])
        self.history.answers += 1
        if set(data["choices"][0]["token_ids"]) - {marker_token(g)}:
            self.history.cross_generation.append(str(data["rollout"]["id"]))

    async def _client(self, seed: int, max_tokens: int) -> None:
        rng = random.Random(seed)
        h = self.history
        async with httpx.AsyncClient(base_url=self.router_url, timeout=120) as http:
            while not self._stop.is_set():
                body = {
                    "model": "rolloutpool",
                    "prompt": [rng.randrange(3, 2000) for _ in range(8)],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "return_token_ids": True,
                    "ignore_eos": True,
                }
                try:
                    r = await http.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    h.error(type(e).__name__)
                    await asyncio.sleep(0.1)
                    continue
                if r.status_code != 200:
                    code = r.json().get("error", {}).get("code", "") if r.content else ""
                    h.error(f"http {r.status_code} {code}".strip())
                    await asyncio.sleep(0.05)
                    continue
                self._check_answer(r.json())

    async def hold_session(self, replica_id: str, timeout_s: float = 30.0) -> str:
        """Open rollout sessions through the router until one is bound to ``replica_id``
        and return its id (the others are closed again). Its binding holds any drain of that
        replica until :meth:`close_session`."""
        others: list[str] = []
        async with httpx.AsyncClient(base_url=self.router_url, timeout=10) as c:
            try:
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    r = await c.post("/v1/rollouts", json={})
                    if r.status_code != 201:
                        await asyncio.sleep(0.05)
                        continue
                    doc = r.json()
                    if doc["replica"] == replica_id:
                        return str(doc["rollout_id"])
                    others.append(str(doc["rollout_id"]))  # open: the next goes elsewhere
                raise TimeoutError(f"no session bound to {replica_id} within {timeout_s:g} s")
            finally:
                for rid in others:
                    await c.post(f"/v1/rollouts/{rid}/close")

    async def hold_epoch_gate(self, ttl_s: float = 60.0) -> None:
        """Register a router that has not verified the current failover epoch: the updater's
        epoch gate (between QUIESCED and the transfer) waits for it, up to the gate's timeout,
        until :meth:`release_epoch_gate`."""
        epoch = await self.store.failover.epoch()
        await self.store.failover.heartbeat(HOLDING_ROUTER, epoch.number - 1, ttl_s)

    async def release_epoch_gate(self, timeout_s: float = 30.0) -> None:
        """Take that registration out (retried while Redis is away; it expires by itself)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.store.failover.heartbeat(HOLDING_ROUTER, None, 1.0)
                return
            except StoreError:
                if time.monotonic() >= deadline:
                    return
                await asyncio.sleep(0.1)

    async def close_session(self, rollout_id: str, timeout_s: float = 30.0) -> None:
        """Close a session (retried while the router or Redis is away; past ``timeout_s`` it
        is left to its lease, ``2 x lease_s``)."""
        async with httpx.AsyncClient(base_url=self.router_url, timeout=5) as c:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    r = await c.post(f"/v1/rollouts/{rollout_id}/close")
                    if r.status_code < 500:
                        return
                await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ the verdict

    async def quiesce(self, timeout_s: float | None = None) -> int:
        """Stop the clients and the sampler; return the bindings still active once every
        lease could have been reaped (``3 x lease_s`` by default), 0 as soon as none is."""
        self._stop.set()
        for t in self._tasks:
            with contextlib.suppress(Exception):
                await t
        self._tasks.clear()
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 3 * self.lease_s)
        while True:
            active = sum(r.active for r in await self.store.replicas())
            if active == 0 or time.monotonic() >= deadline:
                return active
            await asyncio.sleep(0.1)

    async def stale_token_writes(self) -> list[str]:
        """Journal entries whose fencing token is below one written before them."""
        top, bad = 0, []
        for e in await self.store.journal():
            raw = e.fields.get("fence", "")
            if not raw.isdigit():
                continue
            token = int(raw)
            if token < top:
                bad.append(f"{e.id} {e.fields.get('type')} {e.fields.get('replica', '')} {token}")
            top = max(top, token)
        return bad

    async def orphaned_processes(self, grace_s: float = 30.0) -> list[str]:
        """Processes whose working directory is under an updater's (its replicas) that are still
        there ``grace_s`` after the call (a group being stopped takes a moment to exit), as
        ``"<pid> <cwd> <command line>"``; call once no updater lives. Returns as soon as there
        are none."""
        deadline = time.monotonic() + grace_s
        while True:
            found = await asyncio.to_thread(self._processes_here)
            if not found or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(0.1)

    def _processes_here(self) -> list[str]:
        dirs = [self.workdir / up.name for up in self.updaters]  # their replicas' work dirs
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cwd = os.readlink(entry / "cwd")
                if any(cwd.startswith(f"{d}{os.sep}") for d in dirs) and runs(
                    int(entry.name), start_ticks(int(entry.name)) or -1
                ):
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{entry.name} {cwd} {cmd[:300]}")
        return sorted(found)

    async def verdict(self) -> dict[str, Any]:
        """The checks of the module docstring (after :meth:`quiesce`)."""
        recs = await self.store.replicas()
        updates = await self.store.updates(1000)
        return {
            "answers": self.history.answers,
            "client_errors": dict(self.history.errors),
            "cross_generation": len(self.history.cross_generation),
            "unvalidated_ready": self.history.unvalidated_ready[:5],
            "stale_token_writes": await self.stale_token_writes(),
            "leaked_bindings": sum(r.active for r in recs),
            "records_left_running": [u.id for u in updates if not u.state.final],
            "samples": self.history.samples,
        }


__all__ = ["ADMIN", "History", "Rig", "UpdaterProc", "marker"]
