"""The updater service: one per pool at a time (I8), owning every replica state change.

What runs, once :meth:`Updater.start` returns:

* the **lease keeper** renews the updater lease; if the lease is lost, the service stops acting
  (every fenced write would be refused anyway) and :attr:`Updater.lost` is set;
* the **update worker** takes pushed updates in order (a newer queued update supersedes older
  queued ones when ``coalesce`` is on), declares the generation, and rolls it out with
  :func:`updater.plan.next_batch` and the :class:`~updater.cycle.CycleRunner`. The first replica
  to become READY publishes the generation. If the first replica of an update fails (refused
  checkpoint, failed validation), the update stops there: nothing was published;
* the **supervisor** checks each READY replica every ``health_interval_s`` (process alive and
  ``/health`` within ``health_timeout_s``); after ``health_failures`` misses, or when the store
  says TAINTED (a router's violation check), the replica is tainted, its active bindings are
  aborted with a reason, and — for locally launched replicas — it is restarted, loads the latest
  generation from scratch, is validated and only then becomes READY (I6).

A per-replica lock keeps cycles and recoveries of one replica from overlapping. ``start`` blocks
while another updater holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import (
    RolloutPoolError,
    StaleFencingToken,
    StoreConflict,
    StoreUnavailable,
)
from pool.launcher import LocalReplica
from pool.lifecycle import Lifecycle
from pool.metrics import UpdaterMetrics
from pool.store import RedisStore, UpdaterLease
from pool.types import Generation, GenerationRecord, ReplicaRecord, ReplicaState, WeightIdentity
from updater import plan
from updater.cycle import CycleError, CycleReport, CycleRunner, Probe, ReplicaHandle, UpdateTarget
from updater.settings import ReplicaConfig, UpdaterSettings
from updater.transports import registry as transports
from updater.transports.base import Transport, WeightsTarget

log = logging.getLogger(__name__)
S = ReplicaState
#: States only a running cycle may hold; found there with no cycle, a replica is orphaned.
ORPHANABLE = frozenset(
    {
        S.DRAINING,
        S.QUIESCED,
        S.UPDATING,
        S.INVALIDATING,
        S.VALIDATING,
        S.RESUMING,
        S.RECOVERING,
        S.UNINITIALIZED,
    }
)


# ---------------------------------------------------------------------- API models


class ProbeSpec(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1, max_length=4096)
    expected_token_ids: list[int] = Field(min_length=1, max_length=256)


class UpdateRequest(BaseModel):
    """``POST /v1/updates``: a checkpoint directory and what it is declared to be."""

    model_config = {"extra": "forbid"}

    checkpoint: str = Field(min_length=1, description="absolute path of a safetensors directory")
    label: str | None = Field(default=None, max_length=128)
    trainer_run: str = ""
    step: int | None = Field(default=None, ge=0)
    content_hash: str | None = None
    probe: ProbeSpec

    @field_validator("checkpoint")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not Path(v).is_absolute():
            raise ValueError("checkpoint must be an absolute path")
        return v


class UpdateState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SUPERSEDED = "superseded"


class UpdateRecord(BaseModel):
    id: str
    state: UpdateState
    generation: int
    label: str
    checkpoint: str
    identity_digest: str
    created_ms: int
    started_ms: int | None = None
    finished_ms: int | None = None
    replicas: dict[str, dict[str, Any]] = Field(default_factory=dict)
    error: str = ""


def _now_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------------- replicas


@dataclass
class ManagedReplica:
    config: ReplicaConfig
    handle: ReplicaHandle
    launcher: LocalReplica | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    misses: int = 0
    recovering: asyncio.Task[None] | None = None
    quarantined: bool = False  # tainted and its bindings aborted; waiting for recovery
    seen_down: bool = False  # (external replicas) the server was unreachable since quarantine

    @property
    def id(self) -> str:
        return self.config.id


class Updater:
    """See the module docstring. Not thread-safe; one event loop."""

    def __init__(
        self,
        settings: UpdaterSettings,
        store: RedisStore,
        *,
        transport: Transport | None = None,
        metrics: UpdaterMetrics | None = None,
        coalesce: bool = True,
    ) -> None:
        if not settings.replicas:
            raise RolloutPoolError("the updater needs at least one replica")
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.coalesce = coalesce
        self.lease: UpdaterLease = store.updater_lease(f"updater-{uuid.uuid4().hex[:8]}")
        if transport is None:
            transport = transports.create(settings)
        self.runner = CycleRunner(
            store,
            self.lease,
            transport,
            deadlines=settings.deadlines,
            drain_policy=settings.drain_policy,
            drain_timeout_s=settings.drain_timeout_s,
        )
        self.replicas: dict[str, ManagedReplica] = {}
        for cfg in settings.replicas:
            launcher = LocalReplica(cfg.launch) if cfg.launch is not None else None
            # an explicit url wins over the launcher's (e.g. a proxy in front of the server)
            url = cfg.url if cfg.url is not None else launcher.url  # type: ignore[union-attr]
            engine = VllmEngine(url, timeout=settings.deadlines.resume_s)
            handle = ReplicaHandle(cfg.id, engine, read_manifest(cfg.model))
            self.replicas[cfg.id] = ManagedReplica(cfg, handle, launcher)
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._records: dict[str, UpdateRecord] = {}
        self._targets: dict[str, UpdateTarget] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self.lost = asyncio.Event()
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------ start / stop

    async def start(self, lease_timeout_s: float | None = None) -> None:
        """Acquire the lease (blocks while another updater holds it), start (or adopt) every
        replica on the latest generation, then start the worker and the supervisor."""
        await self.lease.acquire(blocking_timeout_s=lease_timeout_s)
        self._tasks.append(asyncio.create_task(self._keep_lease(), name="lease"))
        launches = [m.launcher.start() for m in self.replicas.values() if m.launcher]
        if launches:
            await asyncio.gather(*launches)
        await self._join_all()
        self._tasks.append(asyncio.create_task(self._worker(), name="worker"))
        self._tasks.append(asyncio.create_task(self._supervise(), name="supervisor"))
        self.ready.set()

    async def stop(self, *, stop_replicas: bool = True) -> None:
        for t in self._tasks:
            t.cancel()
        for m in self.replicas.values():
            if m.recovering is not None:
                m.recovering.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for m in self.replicas.values():
            await m.handle.engine.aclose()
            if stop_replicas and m.launcher is not None:
                await m.launcher.stop()
        await self.lease.release()

    async def _keep_lease(self) -> None:
        """Renew the lease every third of its TTL. While Redis is unreachable, retry every
        second (nothing else can proceed meanwhile either). If the lease expired and nobody took
        it, take it again (a new fencing token); if another updater holds it, stop acting."""
        interval = self.store.settings.updater_lease_s / 3
        while True:
            await asyncio.sleep(interval)
            while True:
                try:
                    await self.lease.extend()
                    break
                except StoreUnavailable:
                    await asyncio.sleep(1.0)
                except StaleFencingToken:
                    try:
                        token = await self.lease.acquire(blocking_timeout_s=0)
                        log.warning("updater lease had expired; re-acquired (token %d)", token)
                        break
                    except (StoreConflict, StoreUnavailable):
                        log.error("updater lease lost to another updater: this one stops acting")
                        self.lost.set()
                        for t in self._tasks:
                            if t is not asyncio.current_task():
                                t.cancel()
                        return

    # ------------------------------------------------------------------ joining

    async def _initial_generation(self) -> GenerationRecord:
        """The published generation's record, or g0 declared from the first replica's model
        (its probe's expected output taken from that replica: g0 is what it was started on)."""
        latest = await self.store.latest()
        if latest is not None:
            return await self.store.generation_record(latest[0].number)
        first = next(iter(self.replicas.values()))
        await first.handle.engine.bootstrap()
        prompt = self.settings.initial_probe_prompt
        expected = await first.handle.engine.complete(
            list(prompt),
            max_tokens=self.settings.initial_probe_tokens,
            temperature=0.0,
            cache_salt="g0-probe",
        )
        model = first.config.model.resolve()
        ident = WeightIdentity(
            manifest_digest=first.handle.manifest.digest,
            checkpoint_uri=str(model),
            trainer_run="initial",
        )
        rec = GenerationRecord(
            generation=Generation(number=0, label=self.settings.initial_label),
            identity=ident,
            checkpoint=str(model),
            probe_prompt=tuple(prompt),
            probe_expected=expected,
        )
        await self.store.declare_generation(rec, self.lease.require())
        return rec

    async def _join_all(self) -> None:
        gen = await self._initial_generation()
        await asyncio.gather(*(self._join(m, gen) for m in self.replicas.values()))

    async def _join(self, m: ManagedReplica, gen: GenerationRecord) -> None:
        """Register ``m`` and bring it to READY on ``gen``; a replica left mid-cycle or READY by
        an earlier updater is not trusted: tainted and re-bootstrapped (fresh where launched)."""
        token = self.lease.require()
        state = await self.store.register_replica(
            m.id, m.handle.engine.url, token, capacity=m.config.capacity
        )
        async with m.lock:
            if state is S.UNINITIALIZED:
                m.handle.lc = Lifecycle()
            else:
                await self.store.taint(
                    m.id, "updater (re)start: state not trusted", source="updater"
                )
                await self.store.abort_active(m.id, "updater restart")
                m.handle.lc = Lifecycle(state=S.TAINTED)
                await self.runner.start_recovery(m.handle, "updater (re)start")
            try:
                await self._bootstrap(m, gen)
            except CycleError as e:
                log.error("replica %s failed to join: %s", m.id, e)

    async def _bootstrap(self, m: ManagedReplica, gen: GenerationRecord) -> CycleReport:
        started_on = (m.config.launch.model if m.config.launch else m.config.model).resolve()
        checkpoint = None if Path(gen.checkpoint) == started_on else Path(gen.checkpoint)
        probe = Probe(gen.probe_prompt, gen.probe_expected)
        return await self.runner.bootstrap(
            m.handle, gen.generation, gen.identity, probe, checkpoint
        )

    # ------------------------------------------------------------------ updates

    async def submit(self, req: UpdateRequest) -> UpdateRecord:
        """Check the checkpoint (read-only preflight against the pool's manifest), allocate the
        next generation number and queue the update. Raises :class:`PreflightFailed`."""
        path = Path(req.checkpoint)
        first = next(iter(self.replicas.values()))
        manifest = await asyncio.to_thread(read_manifest, path)  # PreflightFailed: refused
        ident = WeightIdentity(
            manifest_digest=manifest.digest,
            checkpoint_uri=str(path),
            trainer_run=req.trainer_run,
            step=req.step,
            content_hash=req.content_hash,
        )
        await self.runner.transport.preflight(
            first.handle.engine, WeightsTarget(ident, path, first.handle.manifest)
        )
        number = await self._next_number()
        gen = Generation(number=number, label=req.label or f"g{number}")
        probe = Probe(tuple(req.probe.prompt_token_ids), tuple(req.probe.expected_token_ids))
        rec = UpdateRecord(
            id=f"up-{uuid.uuid4().hex[:12]}",
            state=UpdateState.QUEUED,
            generation=number,
            label=gen.label,
            checkpoint=str(path),
            identity_digest=ident.digest,
            created_ms=_now_ms(),
        )
        self._records[rec.id] = rec
        self._targets[rec.id] = UpdateTarget(gen, ident, path, probe)
        await self._save(rec)
        await self._queue.put(rec.id)
        return rec

    async def _next_number(self) -> int:
        numbers = [r.generation.number for r in await self.store.generation_records()]
        numbers += [r.generation for r in self._records.values()]
        return max(numbers, default=-1) + 1

    async def _save(self, rec: UpdateRecord) -> None:
        await self.store.save_update(rec.id, rec.created_ms, rec.model_dump_json())

    async def get(self, update_id: str) -> UpdateRecord:
        if update_id in self._records:
            return self._records[update_id]
        return UpdateRecord.model_validate_json(await self.store.update_json(update_id))

    async def list(self, limit: int = 100) -> list[UpdateRecord]:
        return [UpdateRecord.model_validate_json(j) for j in await self.store.updates_json(limit)]

    async def wait_idle(self) -> None:
        await self._queue.join()

    async def _worker(self) -> None:
        while True:
            uid = await self._queue.get()
            try:
                rec = self._records[uid]
                newer = [
                    r
                    for r in self._records.values()
                    if r.state is UpdateState.QUEUED and r.generation > rec.generation
                ]
                if self.coalesce and newer:
                    rec.state, rec.finished_ms = UpdateState.SUPERSEDED, _now_ms()
                    rec.error = f"superseded by g{max(r.generation for r in newer)}"
                    await self._save(rec)
                    continue
                await self._roll(rec, self._targets[uid])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the update fails; the worker keeps going
                log.exception("update %s failed", uid)
                rec = self._records[uid]
                rec.state, rec.error, rec.finished_ms = UpdateState.FAILED, str(e), _now_ms()
                await self._save(rec)
            finally:
                self._queue.task_done()

    async def _roll(self, rec: UpdateRecord, target: UpdateTarget) -> None:
        """Roll ``target`` out over the pool (see :mod:`updater.plan`)."""
        s = self.settings
        gen_rec = GenerationRecord(
            generation=target.generation,
            identity=target.identity,
            checkpoint=str(target.path),
            probe_prompt=target.probe.prompt_token_ids,
            probe_expected=target.probe.expected,
        )
        await self.store.declare_generation(gen_rec, self.lease.require())
        rec.state, rec.started_ms = UpdateState.RUNNING, _now_ms()
        await self._save(rec)
        attempted: set[str] = set()
        running: dict[str, asyncio.Task[CycleReport]] = {}
        published = False
        while True:
            records = await self.store.replicas()
            latest = await self.store.latest()
            published = latest is not None and latest[0].number >= target.generation.number
            if not running and plan.done(records, target.generation.number):
                break
            # before the generation is published, one replica at a time: it must prove it first
            batch = (
                []
                if (not published and running)
                else plan.next_batch(
                    records,
                    target.generation.number,
                    None if latest is None else latest[0].number,
                    max_unavailable=s.max_unavailable - len(running),
                    min_serving=s.min_serving,
                    max_staleness=s.max_staleness,
                    exclude=attempted,
                )
            )
            for rid in batch:
                attempted.add(rid)
                running[rid] = asyncio.create_task(self._cycle(self.replicas[rid], target))
            if not running:
                if not batch:
                    rec.error = "no replica left to update (tainted or refused)"
                    break
                continue
            done, _ = await asyncio.wait(
                running.values(), timeout=0.25, return_when=asyncio.FIRST_COMPLETED
            )
            for rid, task in list(running.items()):
                if task not in done:
                    continue
                del running[rid]
                report = task.result()
                rec.replicas[rid] = report.to_dict()
                await self._save(rec)
                if report.outcome != "ready" and not published:
                    for t in running.values():
                        await t
                    rec.error = f"{rid}: {report.outcome}: {report.reason}"
                    rec.state, rec.finished_ms = UpdateState.FAILED, _now_ms()
                    self._count("failed")
                    await self._save(rec)
                    return
        ok = published and not rec.error
        rec.state = UpdateState.SUCCEEDED if ok else UpdateState.FAILED
        rec.finished_ms = _now_ms()
        self._count("succeeded" if ok else "failed")
        await self._save(rec)

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.updates.labels(result).inc()

    async def _cycle(self, m: ManagedReplica, target: UpdateTarget) -> CycleReport:
        async with m.lock:
            try:
                report = await self.runner.run(m.handle, target)
            except CycleError as e:
                report = e.report
            except RolloutPoolError as e:  # a lost CAS etc.: nothing more to do on it here
                report = CycleReport(
                    m.id, target.generation.number, outcome="failed", reason=str(e)
                )
        if self.metrics is not None:
            for phase, secs in report.phases.items():
                self.metrics.phase_seconds.labels(phase).observe(secs)
            if report.outcome == "tainted":
                self.metrics.taints.labels(m.id).inc()
        return report

    # ------------------------------------------------------------------ supervision

    async def _supervise(self) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.health_interval_s)
            try:
                records = {r.replica_id: r for r in await self.store.replicas()}
            except RolloutPoolError as e:  # Redis away: no update step proceeds either
                log.warning("supervisor: store unavailable: %s", e)
                continue
            checks = [self._check(m, records.get(m.id)) for m in self.replicas.values()]
            for m, res in zip(
                self.replicas.values(),
                await asyncio.gather(*checks, return_exceptions=True),
                strict=True,
            ):
                if isinstance(res, Exception):  # e.g. Redis went away mid-check: next round
                    log.warning("supervisor: check of %s failed: %r", m.id, res)

    async def _check(self, m: ManagedReplica, rec: ReplicaRecord | None) -> None:
        if m.lock.locked() or (m.recovering is not None and not m.recovering.done()):
            return
        if (rec is not None and rec.state is S.TAINTED) or m.handle.lc.state is S.TAINTED:
            reason = (rec.reason if rec is not None else "") or m.handle.lc.reason or "tainted"
            if m.launcher is not None:
                self._start_recovery(m, reason)
            else:
                await self._watch_external(m, reason)
            return
        if m.handle.lc.state in ORPHANABLE:
            # no cycle or recovery holds it (checked above), yet it is mid-cycle: a step was
            # cut off (e.g. by a Redis outage). Its engine state is unknown: taint and recover.
            await self._orphaned(m, f"left in {m.handle.lc.state} with no cycle running")
            return
        if m.handle.lc.state is not S.READY:
            return
        alive = m.launcher.alive if m.launcher is not None else True
        healthy = alive and await m.handle.engine.health(timeout_s=self.settings.health_timeout_s)
        if healthy:
            m.misses = 0
            return
        m.misses += 1
        if not alive or m.misses >= self.settings.health_failures:
            why = "process exited" if not alive else f"/health failed {m.misses} times"
            reason = f"replica unhealthy: {why}"
            if m.launcher is not None:
                self._start_recovery(m, reason)
            else:
                await self._quarantine(m, reason)

    async def _watch_external(self, m: ManagedReplica, reason: str) -> None:
        """A TAINTED replica this updater did not launch (Kubernetes, compose): an external
        supervisor must replace the process (delete the pod). Once the server has been seen
        down and then answers again, it is a fresh process: re-join it at the latest generation.
        """
        if not m.quarantined:
            await self._quarantine(m, reason)
        if not await m.handle.engine.health(timeout_s=self.settings.health_timeout_s):
            m.seen_down = True
        elif m.seen_down:
            m.recovering = asyncio.create_task(
                self._recover(m, reason, restart=False), name=f"rejoin-{m.id}"
            )

    async def _quarantine(self, m: ManagedReplica, reason: str) -> None:
        """Taint (if not yet) and abort what is bound to it; idempotent."""
        async with m.lock:
            if m.handle.lc.state is not S.TAINTED:
                await self.store.taint(m.id, reason, source="updater")
                m.handle.lc = Lifecycle(state=S.TAINTED, reason=reason)
                if self.metrics is not None:
                    self.metrics.taints.labels(m.id).inc()
            aborted = await self.store.abort_active(m.id, f"replica tainted: {reason}")
            if not m.quarantined:
                log.warning(
                    "replica %s tainted (%s); aborted %d rollouts", m.id, reason, len(aborted)
                )
            m.quarantined, m.seen_down = True, False

    async def _orphaned(self, m: ManagedReplica, reason: str) -> None:
        m.handle.lc = Lifecycle(state=S.TAINTED, reason=reason)
        await self.store.taint(m.id, reason, source="updater")
        if m.launcher is not None:
            self._start_recovery(m, reason)
        else:
            await self._quarantine(m, reason)

    def _start_recovery(self, m: ManagedReplica, reason: str) -> None:
        m.recovering = asyncio.create_task(self._recover(m, reason), name=f"recover-{m.id}")

    async def _recover(self, m: ManagedReplica, reason: str, *, restart: bool = True) -> None:
        """Taint, abort what was bound to it, (re)start it fresh and re-join at the latest
        generation (I6). ``restart=False``: the process was already replaced externally."""
        t0 = time.monotonic()
        await self._quarantine(m, reason)
        if not self.settings.recover:
            return
        async with m.lock:
            m.misses = 0
            try:
                await self.runner.start_recovery(m.handle, reason)
                if restart and m.launcher is not None:
                    m.launcher.kill(signal.SIGKILL)  # fresh start; a hung (SIGSTOPped) one too
                    await m.launcher.restart()
                self.runner.transport.forget(m.handle.engine.url)  # a fresh process
                latest = await self.store.latest()
                assert latest is not None
                gen = await self.store.generation_record(latest[0].number)
                await self._bootstrap(m, gen)
                m.quarantined = False
                result = "succeeded"
                log.info("replica %s recovered in %.1fs", m.id, time.monotonic() - t0)
            except (RolloutPoolError, AssertionError) as e:
                result = "failed"
                log.error("recovery of %s failed: %s", m.id, e)
            if self.metrics is not None:
                self.metrics.recoveries.labels(result).inc()

    # ------------------------------------------------------------------ views

    async def pool_view(self) -> dict[str, Any]:
        latest = await self.store.latest()
        return {
            "latest": None if latest is None else latest[0].model_dump(),
            "replicas": [r.model_dump(mode="json") for r in await self.store.replicas()],
        }


__all__ = ["UpdateRecord", "UpdateRequest", "UpdateState", "Updater"]
