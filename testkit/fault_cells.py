"""The cells of the fault matrix, played on a :class:`~testkit.faults.Rig` of stand-in replicas.

A cell is (component, phase, fault): while replica ``r0`` is in ``phase`` of an update (or of a
recovery, for RECOVERING; READY is steady state), ``component`` gets ``fault``. Stand-ins are
used because a real vLLM replica cannot be held in QUIESCED or VALIDATING long enough to aim
at (its windows are milliseconds); the stand-in is conformance-tested against vLLM CPU on every
path the cycle uses (``tests/integration/test_standin_conformance.py``). A phase is held by the
stand-in's own fault switches: the engine call that begins the next step hangs until the fault
has fired (``HOLDS``; RESUMING: ``HOLDS_AFTER``), or a slow ``reload_weights`` (UPDATING,
RECOVERING); DRAINING and QUIESCED as described below. The cell then polls the record every
~2 ms for the phase, and a cell that missed it says so (``phase_hit``).

Faults per component (``signal``-like on the components that are processes; on a stand-in
replica the fleet's equivalents):

=========  ==========================  ==============================  ======================
component  SIGKILL                     SIGSTOP past the lease          SIGTERM / restart
=========  ==========================  ==============================  ======================
updater    killed; a new one starts    stopped; a new one takes over,  stopped; a new one
                                       the old one resumed, then       starts after it exited
                                       SIGTERMed                       / at once (races it)
router     killed; a new one starts    stopped 2 leases, resumed       stopped; a new one
redis      killed; restarted (AOF)     stopped 2 leases, resumed       stopped; restarted
sentinel   the primary killed: the     the primary stopped past        the primary stopped:
           sentinels promote a         down-after: promoted around     promoted around / back
           replica                     it, then demoted on its return  at once (maybe no
                                                                       failover)
replica    dies                        hangs 2 leases, then answers    dies / restarts
=========  ==========================  ==============================  ======================

Plus, in every phase, ``two_updaters`` (a second updater started mid-update, then the first
killed), on the Sentinel rig, ``replication_stalled`` (every Redis replica stopped for two
leases while the stores wait for one: ``wait_replicas`` 1), and the paths a dead router can
cut under a capacity grant (:mod:`router.grants`), in READY and DRAINING (``GRANT_PHASES``):
a long streamed one-request rollout bound to ``r0`` is opened through the router before the
push (it holds DRAINING through the router's grant, as a session holds it through its
binding), then the router is ``killed_under_grant``
(SIGKILL, a new one started: the grant must lapse with the dead router's registration before
the drain goes on) or ``stopped_under_grant`` (SIGSTOP for 1.5 x ``failover_grace_s``, so its
registration lapses and its grant is reclaimed while it is frozen, then SIGCONT: it must cut
what ran under the grant and deliver none of it). The held stream is checked like every
answer: if it completes, every token must be its generation's marker. ``redis`` cells run on a
rig with a standalone Redis, ``sentinel`` cells on a rig with a Sentinel group
(:mod:`testkit.fault_redis`). After the fault the cell waits for every replica READY on the
latest generation (``converge_s``, from the fault), sends a burst of short completions (every
answer checked against its generation's marker: a replica READY on a process nobody validated
shows up here), then pushes one more update, which must succeed.

On a rig whose updaters have a ``first_wave`` of every replica (``Rig(first_wave=...)``), the
holds apply to every replica, so the fault lands while the whole first wave is in the phase and
the generation is not yet published (``WAVE_PHASES``; DRAINING is held by a session on each).

DRAINING is held by a rollout session the cell opens on ``r0`` before the push and closes once
the fault has fired (a drain waits for every binding). QUIESCED: the same session holds r0 in
DRAINING until a router registration that has not verified the current failover epoch is in
place (the updater's epoch gate, between QUIESCED and the transfer, waits for every live
router); then the session ends, r0 drains, and the gate holds it QUIESCED until the fault has
fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pool.errors import StoreError
from pool.types import ReplicaState
from rolloutpool.local.models import marker_token
from testkit.fault_redis import RedisKind, SentinelRedis
from testkit.faults import Rig, UpdaterProc
from testkit.procs import terminate

S = ReplicaState
PHASES = (
    S.READY,
    S.DRAINING,
    S.QUIESCED,
    S.UPDATING,
    S.INVALIDATING,
    S.VALIDATING,
    S.RESUMING,
    S.RECOVERING,
)
COMPONENTS = ("updater", "router", "replica", "redis", "sentinel")
FAULTS = ("SIGKILL", "SIGSTOP", "SIGTERM", "restart")
#: Cells beyond component x fault, played in every phase: (component, fault).
EXTRA = (
    ("updater", "two_updaters"),
    ("sentinel", "replication_stalled"),
    ("router", "killed_under_grant"),
    ("router", "stopped_under_grant"),
)


def redis_of(component: str) -> RedisKind:
    """The rig's Redis a component's cells need."""
    return "sentinel" if component == "sentinel" else "standalone"


#: The phases a first-wave rig holds every replica in before the publish.
WAVE_PHASES = (S.DRAINING, S.UPDATING, S.INVALIDATING, S.VALIDATING, S.RESUMING)

#: The phases the *_under_grant cells are played in: the stream they hold keeps any drain
#: from ending while it runs, so the phases after DRAINING are not reached under it.
GRANT_PHASES = (S.READY, S.DRAINING)

#: The engine path that, hung, holds a cycle in the phase (the first call of the next step).
HOLDS: dict[S, frozenset[str]] = {
    S.INVALIDATING: frozenset({"/reset_prefix_cache"}),
    S.VALIDATING: frozenset({"/update_weight_version"}),
}
#: A path that, hung once its trigger path was answered, holds the phase: RESUMING's only
#: engine call is ``is_paused``, which VALIDATING also makes (resume confirms with it) before it
#: reads the label back (``weight_info``).
HOLDS_AFTER: dict[S, dict[str, str]] = {S.RESUMING: {"/is_paused": "/weight_info"}}
SLOW_TRANSFER_S = 3.0


@dataclass
class CellResult:
    component: str
    phase: str
    fault: str
    first_wave: int = 1
    phase_hit: bool = False
    converge_s: float | None = None
    next_update: str = ""
    cross_generation: int = 0
    records_left_running: int = 0
    #: of the probe burst sent right after convergence (checked like every answer)
    probes_answered: int = 0
    #: how the stream held under a grant ended (the *_under_grant cells)
    held_stream: str = ""
    error: str = ""
    #: seconds each step of the cell took (hold, fault, converge, next update)
    steps: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(
            self.error
            or self.converge_s is None
            or self.cross_generation
            or self.records_left_running
            or self.next_update != "succeeded"
        )

    def row(self) -> dict[str, Any]:
        return {**self.__dict__, "failed": self.failed}


class Matrix:
    """Plays cells one after another on one rig (each starts converged, with one updater)."""

    def __init__(self, rig: Rig, converge_timeout_s: float = 120.0) -> None:
        self.rig = rig
        self.converge_timeout_s = converge_timeout_s
        self.updater: UpdaterProc | None = None
        self.generation = 0
        self._n = 0

    async def start(self) -> None:
        self.updater = await self._new_updater()
        await self.rig.converged(self.converge_timeout_s)

    async def _new_updater(self, *, wait: bool = True) -> UpdaterProc:
        self._n += 1
        return await self.rig.start_updater(f"u{self._n}", wait=wait)

    async def _clear_holds(self) -> None:
        with contextlib.suppress(Exception):
            await self.rig.release_epoch_gate()
        with contextlib.suppress(Exception):
            await self.rig.fleet(
                "faults", "all", {"hang": False, "hang_paths": [], "hang_after": {}}
            )
            await self.rig.fleet("time", "all", {"transfer_s": 0.0})

    async def play(self, component: str, phase: S, fault: str) -> CellResult:
        res = CellResult(component, phase.value, fault, self.rig.first_wave)
        cross0 = len(self.rig.history.cross_generation)
        try:
            await self._play(res, component, phase, fault)
        except Exception as e:  # the cell fails with the reason; the next starts afresh
            res.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            await self._clear_holds()
        res.cross_generation = len(self.rig.history.cross_generation) - cross0
        return res

    async def _play(self, res: CellResult, component: str, phase: S, fault: str) -> None:
        rig, up = self.rig, self.updater
        assert up is not None
        pushed: asyncio.Task[dict[str, Any]] | None = None
        wave = rig.first_wave > 1
        if wave and phase not in WAVE_PHASES:
            raise ValueError(f"a first-wave rig holds {[p.value for p in WAVE_PHASES]} only")
        held = await HeldStream.open(rig, "r0") if fault.endswith("_under_grant") else None
        by_session = phase in (S.DRAINING, S.QUIESCED) and held is None
        session = await rig.hold_session("r0") if by_session else None
        # a first wave's other members are held too (r1 ... with r0, before any publish)
        others = [await rig.hold_session(f"r{i}") for i in range(1, rig.first_wave) if by_session]
        target: int | str = "all" if wave else 0
        if phase in HOLDS:
            await rig.fleet("faults", target, {"hang_paths": sorted(HOLDS[phase])})
        if phase in HOLDS_AFTER:
            await rig.fleet("faults", target, {"hang_after": HOLDS_AFTER[phase]})
        if phase in (S.UPDATING, S.RECOVERING):
            await rig.fleet("time", target, {"transfer_s": SLOW_TRANSFER_S})
        if phase is S.RECOVERING:
            await rig.store.taint("r0", "fault matrix: recover me", source="test")
        elif phase is not S.READY:
            self.generation += 1
            pushed = asyncio.create_task(rig.push(up, self.generation, wait=False))
        t = time.monotonic()

        def step(name: str) -> None:
            nonlocal t
            now = time.monotonic()
            res.steps[name] = round(now - t, 2)
            t = now

        try:
            past = None if pushed is None else self.generation
            if phase is S.QUIESCED and session is not None:
                # r0 drains (held); the gate then holds it once it is drained and paused
                await rig.wait_phase("r0", S.DRAINING, 60, past=past)
                await rig.hold_epoch_gate()
                await rig.close_session(session)
                session = None
            await rig.wait_phase("r0", phase, 60, past=past)
            res.phase_hit = True
        except TimeoutError:
            res.phase_hit = False
        step("hold")
        t_fault = time.monotonic()
        await self._fault(component, fault)
        await self._clear_holds()
        if session is not None:
            await rig.close_session(session)
        for other in others:
            await rig.close_session(other)
        if phase is S.QUIESCED:
            await rig.release_epoch_gate()
        if held is not None:
            res.held_stream, mixed = await held.outcome()
            if mixed:
                rig.history.cross_generation.append(f"held stream: {res.held_stream}")
        step("fault")
        if pushed is not None:
            with contextlib.suppress(Exception):
                await pushed
        await rig.converged(self.converge_timeout_s)
        res.converge_s = round(time.monotonic() - t_fault, 2)
        step("converge")
        res.probes_answered = await rig.probe()
        step("probe")
        assert self.updater is not None
        await self._wait_updates_final()
        step("records")
        self.generation += 1
        rec = await rig.push(self.updater, self.generation)
        res.next_update = str(rec["state"])
        step("next_update")
        res.records_left_running = await self._records_running()

    async def _records_running(self, timeout_s: float = 30.0) -> int:
        """Update records not final; the rig's own read retried while its connection to a
        Redis that just restarted is re-made."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return sum(1 for u in await self.rig.store.updates(50) if not u.state.final)
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _wait_updates_final(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                if all(u.state.final for u in await self.rig.store.updates(50)):
                    return
            await asyncio.sleep(0.1)

    async def _fault(self, component: str, fault: str) -> None:
        rig = self.rig
        hold = 2 * rig.lease_s
        if component == "updater":
            await self._updater_fault(fault)
        elif component == "router":
            proc = rig.router
            if fault in ("SIGSTOP", "stopped_under_grant"):
                if fault == "stopped_under_grant":  # past its registration: grants reclaimed
                    hold = 1.5 * rig.store.settings.failover_grace_s
                proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(hold)  # the fault itself: stopped past its heartbeat
                proc.send_signal(signal.SIGCONT)
                return
            kill = fault in ("SIGKILL", "killed_under_grant")
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            await asyncio.to_thread(terminate, proc, 30.0)
            await rig.start_router()
        elif component in ("redis", "sentinel"):
            if rig.redis.kind != redis_of(component):
                raise ValueError(f"{component} cells need a rig with {component} Redis")
            if fault == "replication_stalled":
                assert isinstance(rig.redis, SentinelRedis)
                await rig.redis.stall_replication(hold)
            else:
                await rig.redis.fault(fault, hold)
        elif component == "replica":
            if fault == "SIGSTOP":
                await rig.fleet("faults", 0, {"hang": True})
                await asyncio.sleep(hold)
                await rig.fleet("faults", 0, {"hang": False, "hang_paths": []})
            elif fault == "restart":
                await rig.fleet("restart", 0)
            else:
                await rig.fleet("die", 0)
        else:
            raise ValueError(f"unknown component {component!r}")

    async def _updater_fault(self, fault: str) -> None:
        rig, old = self.rig, self.updater
        assert old is not None
        if fault == "SIGKILL":
            rig.signal(old, signal.SIGKILL)
            await rig.wait_exit(old)
            self.updater = await self._new_updater()
        elif fault == "SIGSTOP":
            rig.signal(old, signal.SIGSTOP)
            self.updater = await self._new_updater()  # takes the lease once it expired
            rig.signal(old, signal.SIGCONT)
            await lease_lost(old.url)
            rig.signal(old, signal.SIGTERM)
            await rig.wait_exit(old, 120)
        elif fault == "SIGTERM":
            rig.signal(old, signal.SIGTERM)
            await rig.wait_exit(old, 120)
            self.updater = await self._new_updater()
        elif fault == "restart":
            rig.signal(old, signal.SIGTERM)
            self.updater = await self._new_updater()  # races the old one's shutdown
            await rig.wait_exit(old, 120)
        elif fault == "two_updaters":
            second = await self._new_updater(wait=False)  # blocks on the lease meanwhile
            rig.signal(old, signal.SIGKILL)
            await rig.wait_exit(old)
            await rig.wait_ready(second)
            self.updater = second
        else:
            raise ValueError(f"unknown updater fault {fault!r}")


@dataclass
class HeldStream:
    """A streamed one-request rollout through the router, bound to one replica, read in the
    background until it ends (see the module docstring)."""

    task: asyncio.Task[tuple[str, bool]]

    @classmethod
    async def open(
        cls, rig: Rig, replica_id: str, tokens: int = 6000, timeout_s: float = 30.0
    ) -> HeldStream:
        """Open streams until one is bound to ``replica_id`` (its headers say so).

        A stream bound elsewhere is kept open until then: the router prefers the least busy
        replica, so a ``replica_id`` still busy (e.g. with a stream of the router killed in the
        cell before) is chosen once the others are busier; the extra streams are closed after.
        """
        client = httpx.AsyncClient(base_url=rig.router_url, timeout=None)
        elsewhere: list[httpx.Response] = []
        body = {
            "model": "rolloutpool",
            "prompt": [5, 6, 7, 8],
            "max_tokens": tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                resp = await client.send(
                    client.build_request("POST", "/v1/completions", json=body), stream=True
                )
                if resp.status_code != 200:
                    await resp.aclose()
                    await asyncio.sleep(0.05)
                elif resp.headers.get("X-Rollout-Replica") == replica_id:
                    return cls(asyncio.create_task(_read_held(client, resp)))
                else:
                    elsewhere.append(resp)
        finally:
            for other in elsewhere:
                await other.aclose()
        await client.aclose()
        raise TimeoutError(f"no stream bound to {replica_id} within {timeout_s:g} s")

    async def outcome(self, timeout_s: float = 120.0) -> tuple[str, bool]:
        """(how it ended, whether it completed with a token of another generation)."""
        try:
            return await asyncio.wait_for(self.task, timeout_s)
        except TimeoutError:
            return "still running", False


async def _read_held(client: httpx.AsyncClient, resp: httpx.Response) -> tuple[str, bool]:
    generation = int(resp.headers["X-Rollout-Generation"])
    tokens: set[int] = set()
    end = "ended without [DONE]"
    try:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                end = "completed"
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                end = f"error event: {chunk['error'].get('code')}"
                continue
            for choice in chunk.get("choices") or []:
                tokens.update(choice.get("token_ids") or [])
    except httpx.HTTPError as e:
        end = f"connection lost: {type(e).__name__}"
    finally:
        await resp.aclose()
        await client.aclose()
    mixed = end == "completed" and bool(tokens - {marker_token(generation)})
    return end, mixed


async def lease_lost(url: str, timeout_s: float = 120.0) -> None:
    """Wait until an updater's /healthz says it no longer holds the lease."""
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = await c.get(url + "/healthz", timeout=5)
            if r.status_code != 200 and r.json().get("lease") is False:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("the stopped updater never noticed it lost the lease")


async def real_sample(workdir: Path, converge_s: float = 600.0) -> dict[str, Any]:
    """The fixed sample on real vLLM CPU (one replica, the ``local`` provider): updater
    SIGKILLed while READY (its replica must end with it), SIGKILLed mid-update (DRAINING: its
    record must not stay running), SIGSTOPped past its lease while a second takes over, then
    resumed (it must write nothing) and SIGTERMed (it must leave the new holder's replica
    alone). Returns the rig's verdict plus ``orphaned_processes`` and ``checks`` (each
    step's observation); raises if a step cannot complete."""
    checks: dict[str, Any] = {}
    async with Rig(workdir, replicas=1, lease_s=3.0) as rig:
        a = await rig.start_updater("a")
        checks["first_update"] = (await rig.push(a, 1))["state"]
        rig.load(clients=2)

        before = await rig.store.replica("r0")
        process = rig.process_of(before)
        assert process is not None, before.process
        rig.signal(a, signal.SIGKILL)
        await rig.wait_exit(a)
        checks["replica_gone_with_its_updater_s"] = round(await rig.wait_gone(process), 2)
        b = await rig.start_updater("b")
        checks["converge_after_kill_s"] = round(await rig.converged(converge_s), 2)
        rec = await rig.store.replica("r0")
        checks["after_kill"] = {"new_url": rec.url != before.url, "generation": rec.generation}

        pushed = asyncio.create_task(rig.push(b, 2, wait=False))
        await rig.wait_phase("r0", S.DRAINING)
        rig.signal(b, signal.SIGKILL)
        await rig.wait_exit(b)
        await pushed
        c = await rig.start_updater("c")
        checks["converge_after_kill_mid_update_s"] = round(await rig.converged(converge_s), 2)
        checks["update_after_kill_mid_update"] = (await rig.push(c, 3))["state"]

        rig.signal(c, signal.SIGSTOP)
        d = await rig.start_updater("d")
        checks["converge_after_takeover_s"] = round(await rig.converged(converge_s), 2)
        rig.signal(c, signal.SIGCONT)
        await lease_lost(c.url)
        rig.signal(c, signal.SIGTERM)
        await rig.wait_exit(c)
        rec = await rig.store.replica("r0")
        checks["after_stale_sigterm"] = {"state": rec.state.value, "reason": rec.reason}
        checks["update_after_takeover"] = (await rig.push(d, 4))["state"]

        leaked = await rig.quiesce()
        verdict = await rig.verdict()
        rig.signal(d, signal.SIGTERM)
        await rig.wait_exit(d)
        orphans = await rig.orphaned_processes()
    return {**verdict, "leaked_bindings": leaked, "orphaned_processes": orphans, "checks": checks}


__all__ = [
    "COMPONENTS",
    "EXTRA",
    "FAULTS",
    "GRANT_PHASES",
    "PHASES",
    "CellResult",
    "Matrix",
    "real_sample",
    "redis_of",
]
