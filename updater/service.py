"""The updater service: one per pool at a time (I8), owning every replica state change.

What runs, once :meth:`Updater.start` returns:

* the **lease keeper** (:meth:`pool.store.UpdaterLease.keep_alive`) renews the updater lease; once
  another updater holds it, this one stops acting (every fenced write would be refused anyway)
  and :attr:`Updater.lost` is set;
* the **update worker** takes pushed updates in order (a newer queued update supersedes older
  queued ones when ``coalesce`` is on), declares the generation, and rolls it out with
  :func:`updater.plan.next_batch` and the :class:`~updater.cycle.CycleRunner`. The first replica
  to become READY publishes the generation. If the first wave of an update fails (refused
  checkpoint, failed validation), the update stops there: nothing was published;
* the **supervisor** (:mod:`updater.supervisor`) checks the replicas' health and recovers
  tainted ones (I6).

The replicas' processes are started, restarted and located by the pool's replica provider
(:mod:`updater.providers`, named by ``settings.provider``): local processes, replicas someone
else runs (by URL), Ray actors, or a StatefulSet's pods.

A per-replica lock keeps cycles and recoveries of one replica from overlapping. ``start`` blocks
while another updater holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from pathlib import Path
from typing import Any

from pool.adapters import adapter_name
from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import (
    EngineError,
    NotFound,
    RolloutPoolError,
    StaleFencingToken,
    StoreConflict,
    StoreError,
)
from pool.evidence import ProcessIdentity
from pool.lifecycle import Lifecycle
from pool.metrics import UpdaterMetrics
from pool.records import ReplicaOutcome, ReplicaReport, UpdateRecord, UpdateState
from pool.store import RedisStore, UpdaterLease
from pool.types import Generation, GenerationRecord, ReplicaRecord, ReplicaState, WeightIdentity
from updater import intake, plan
from updater.api import UpdateRequest
from updater.cycle import CycleError, CycleRunner, Probe, ReplicaHandle, UpdateTarget
from updater.failover import EpochGate
from updater.lora import LoraRollout
from updater.pending import PendingUpdate, PendingUpdates, RecordSaver
from updater.providers import registry as providers
from updater.providers.base import ReplicaProvider
from updater.records import Records, now_ms
from updater.replicas import UNPLACED_URL, ManagedReplica
from updater.settings import UpdaterSettings
from updater.supervisor import WAITING_FOR_RESTART, Supervisor
from updater.transports import registry as transports
from updater.transports.base import Transport, WeightsTarget

log = logging.getLogger(__name__)
S = ReplicaState


class Updater:
    """See the module docstring. Not thread-safe; one event loop."""

    def __init__(
        self,
        settings: UpdaterSettings,
        store: RedisStore,
        *,
        transport: Transport | None = None,
        provider: ReplicaProvider | None = None,
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
            gate=EpochGate(store),
        )
        self.provider = provider if provider is not None else providers.create(settings)
        self.replicas: dict[str, ManagedReplica] = {}
        for cfg in settings.replicas:
            url = self.provider.url(cfg.id) or UNPLACED_URL  # placed by start() (Ray)
            engine = VllmEngine(url, timeout=settings.deadlines.resume_s)
            identity = functools.partial(self.provider.incarnation, cfg.id)
            handle = ReplicaHandle(
                cfg.id, engine, read_manifest(cfg.model), provider_identity=identity
            )
            self.replicas[cfg.id] = ManagedReplica(cfg, handle)
        #: A pool whose generations are LoRA adapters (``generations: lora``): its updates,
        #: retiring and recovery (:mod:`updater.lora`); None for full-weight generations.
        self.lora = (
            LoraRollout(self.runner, self.replicas, settings.max_staleness, settings.lora_checksums)
            if settings.generations == "lora"
            else None
        )
        self.supervisor = Supervisor(
            settings,
            store,
            self.runner,
            self.replicas,
            self.provider,
            metrics,
            join=None if self.lora is None else self.lora.bring_up,
        )
        self.pending = PendingUpdates()
        self._savers: dict[str, RecordSaver] = {}  # by update id, while it rolls
        self._tasks: list[asyncio.Task[Any]] = []
        self.lost = asyncio.Event()
        self.records = Records(store, self.lease, self.lost)
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------ start / stop

    async def start(self, lease_timeout_s: float | None = None) -> None:
        """Acquire the lease (blocks while another updater holds it), have the provider start
        (or find) every replica, join them on the latest generation, then start the worker and
        the supervisor. A replica the provider cannot start fails the start
        (:class:`~updater.providers.base.ProviderError`)."""
        await self.lease.acquire(blocking_timeout_s=lease_timeout_s)
        self._tasks.append(asyncio.create_task(self._keep_lease(), name="lease"))
        self._tasks.append(asyncio.create_task(self.records.watch(), name="records"))
        await self.records.finish_interrupted()
        await self._reclaim_all()
        await asyncio.gather(*(self._place(m) for m in self.replicas.values()))
        await self._join_all()
        self._tasks.append(asyncio.create_task(self._worker(), name="worker"))
        self._tasks.append(asyncio.create_task(self.supervisor.run(), name="supervisor"))
        if self.lora is not None:
            self._tasks.append(asyncio.create_task(self._retire_loop(), name="retire"))
        self.ready.set()

    async def _retire_loop(self) -> None:
        """LoRA pools, every ``retire_interval_s``: bring READY replicas left behind up to the
        published generation, and unload adapters nothing holds any more."""
        assert self.lora is not None
        while True:
            await asyncio.sleep(self.settings.retire_interval_s)
            try:
                await self.lora.reconcile()
                await self.lora.retire()
            except RolloutPoolError as e:  # Redis away, the lease lost: next round
                log.warning("reconciling or retiring adapters: %s", e)

    async def stop(self, *, stop_replicas: bool = True) -> None:
        """Stop acting and give the lease up. With ``stop_replicas``, the replicas this updater
        launched (its provider launches them) are tainted first (routers stop admitting to them
        at once; a fenced write), then stopped. An updater that lost the lease writes nothing to
        the store: the replicas' records are the new holder's. It still ends the processes it
        launched where no other updater can have adopted them (:attr:`~updater.providers.base.
        ReplicaProvider.adopts` False: the new holder started its own)."""
        for t in self._tasks:
            t.cancel()
        self.supervisor.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for m in self.replicas.values():
            await m.handle.engine.aclose()
            if not (stop_replicas and self.provider.launches):
                continue
            held = True
            try:  # routers must stop admitting before the process goes
                token = self.lease.require()
                await self.store.taint(
                    m.id, "stopped with its updater", source="updater", token=token
                )
            except StaleFencingToken:
                held = False
            except RolloutPoolError as e:  # Redis away: the process still goes
                log.warning("replica %s not tainted before it stops: %s", m.id, e)
            if not held and self.provider.adopts:
                log.warning("replica %s left running: the lease holder may have adopted it", m.id)
                continue
            await self.provider.stop(m.id)
        await self.records.interrupt(
            [u.record for u in self.pending.unfinished()], "its updater stopped"
        )
        await self.provider.close()
        await self.lease.release()

    async def _keep_lease(self) -> None:
        """Keep the lease; once it is lost to another updater, stop every other task."""
        await self.lease.keep_alive()
        log.error("this updater stops acting")
        self.lost.set()
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    # ------------------------------------------------------------------ joining

    async def _place(self, m: ManagedReplica) -> None:
        """Have the provider start (or find) ``m`` and point its engine client at it."""
        location = await self.provider.start(m.id)
        await m.move_to(location.url)
        log.info("replica %s serves at %s (node %s)", m.id, location.url, location.node_address)

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

    async def _reclaim_all(self) -> None:
        """Before starting replicas: end the processes an earlier updater of this pool left
        running (it crashed, or it was fenced out while stopped), where the provider can tell
        them by their recorded identity (:meth:`~updater.providers.base.ReplicaProvider.
        reclaim`); their records are tainted first, so no router admits to them meanwhile."""
        try:
            records = {r.replica_id: r for r in await self.store.replicas()}
        except StoreError as e:
            log.warning("left-over replicas not checked: %s", e.message)
            return
        for m in self.replicas.values():
            rec = records.get(m.id)
            recorded = ProcessIdentity.decode(rec.process) if rec is not None else None
            if recorded is None or recorded.provider is None:
                continue
            if not await self.provider.reclaimable(m.id, recorded.provider):
                continue
            reason = "its process was left by an earlier updater: ended"
            await self.store.taint(m.id, reason, source="updater", token=self.lease.require())
            await self.store.abort_active(m.id, "updater restart")
            await self.provider.reclaim(m.id, recorded.provider)
            log.warning("replica %s: ended process %s left by an earlier updater", m.id, recorded)

    async def _join(self, m: ManagedReplica, gen: GenerationRecord) -> None:
        """Register ``m`` and bring it to READY on ``gen``.

        A replica registered for the first time is bootstrapped on what it was started with
        (``gen``'s checkpoint loaded if that is another one). A replica an earlier updater left
        behind is adopted only if it is READY on ``gen``, at the same URL, and still the very
        server process that was validated (its weights cannot have changed since: that needs a
        fenced transition out of READY). Anything else is not trusted: it is tainted *before*
        its record points anywhere new (the store's REGISTER also taints a known replica whose
        URL changes), and recovered only from a new process with ``gen`` loaded from scratch
        (I6) — now, if the provider just started a new one; else the supervisor restarts it
        through the provider, or, where the provider cannot restart it, waits until its
        orchestrator has.
        """
        token = self.lease.require()
        url = m.handle.engine.url
        reason = "updater (re)start found it changed: not trusted"
        async with m.lock:
            try:
                rec: ReplicaRecord | None = await self.store.replica(m.id)
            except NotFound:
                rec = None
            current = await self._process(m) if rec is not None else None
            recorded = ProcessIdentity.decode(rec.process) if rec is not None else None
            if rec is not None and not (
                rec.state is S.READY
                and rec.generation == gen.generation.number
                and rec.url == url
                and recorded is not None
                and current == recorded
            ):
                reason = f"updater (re)start found it {rec.state}: not trusted"
                if rec.state is not S.UNINITIALIZED:
                    await self.store.taint(m.id, reason, source="updater", token=token)
            state = await self.store.register_replica(m.id, url, token, capacity=m.config.capacity)
            if state is S.UNINITIALIZED:
                m.handle.lc = Lifecycle()
                await self._bring_up(m, gen, from_scratch=False)
                return
            assert rec is not None  # registered before: it has a record
            if state is S.READY:
                await m.handle.engine.bootstrap()
                m.handle.lc = Lifecycle(
                    S.READY, gen.generation, rec.identity_digest, process=recorded
                )
                log.info("replica %s adopted: READY on %s, same process", m.id, gen.generation)
                return
            await self.store.abort_active(m.id, "updater restart")
            m.handle.lc = Lifecycle(state=S.TAINTED, reason=reason, process=recorded)
            m.quarantined, m.cause = True, reason
            if current is None or not current.replaces(recorded):  # not a new process (or unknown)
                if not self.provider.can_restart:
                    waiting = f"{reason}; {WAITING_FOR_RESTART}"
                    await self.store.transition(m.id, token, S.TAINTED, S.TAINTED, reason=waiting)
                return  # else the supervisor restarts it through the provider
            await self.runner.start_recovery(m.handle, reason)
            await self._bring_up(m, gen, from_scratch=True)

    async def _bring_up(
        self, m: ManagedReplica, gen: GenerationRecord, *, from_scratch: bool
    ) -> None:
        try:
            await self.supervisor.join(m, gen, from_scratch=from_scratch)
            m.quarantined = False
        except RolloutPoolError as e:  # CycleError included: the replica is TAINTED
            log.error("replica %s failed to join: %s", m.id, e)

    async def _process(self, m: ManagedReplica) -> ProcessIdentity | None:
        """The replica's server process identity now (None: unreachable or not reported)."""
        try:
            return await m.handle.process(self.settings.health_timeout_s)
        except EngineError:
            return None

    # ------------------------------------------------------------------ updates

    async def submit(self, req: UpdateRequest) -> UpdateRecord:
        """Check the update (read-only), allocate the next generation number and queue it.

        Refuses, with nothing queued: a checkpoint that is not what the pool serves (manifest,
        declared identity, content hash: :class:`PreflightFailed`), probe token ids outside the
        model's vocabulary (:class:`PreflightFailed`), a label another generation already has
        (:class:`StoreConflict`). Without a label the generation is named ``g<number>``.
        """
        path = Path(req.checkpoint)
        first = next(iter(self.replicas.values()))
        if self.lora is not None:
            rank = self.settings.max_lora_rank
            target = await intake.adapter_target(req, path, first.handle.manifest, rank)
            await intake.check_probe(first.config.model, req)
        else:
            target = await intake.weights_target(req, path, first.handle.manifest)
            await intake.check_probe(path, req)
        return await self._submit(req, target)

    async def _submit(self, req: UpdateRequest, target: WeightsTarget) -> UpdateRecord:
        """Allocate the next generation number for a checked ``target`` and queue it."""
        path, ident = target.path, target.identity
        number = await self._next_number()
        label = await self._free_label(req.label, number)
        gen = Generation(number=number, label=label)
        probe = Probe(tuple(req.probe.prompt_token_ids), tuple(req.probe.expected_token_ids))
        rec = UpdateRecord(
            id=f"up-{uuid.uuid4().hex[:12]}",
            state=UpdateState.QUEUED,
            generation=number,
            label=gen.label,
            checkpoint=str(path),
            identity_digest=ident.digest,
            created_ms=now_ms(),
        )
        await self.store.save_update(rec)
        self.pending.add(PendingUpdate(rec, UpdateTarget(gen, ident, path, probe)))
        return rec

    async def _free_label(self, label: str | None, number: int) -> str:
        """``label`` if no declared or queued generation has it (else StoreConflict); without
        one, ``g<number>`` (with a suffix in the rare case a user already took that name)."""
        queued = self.pending.labels()
        if label is not None:
            owner = await self.store.label_owner(label)
            if owner is not None or label in queued:
                raise StoreConflict(
                    f"label {label!r} already names generation "
                    f"{owner if owner is not None else queued[label]}: labels must be unique",
                    label=label,
                )
            return label
        candidate, n = f"g{number}", 1
        while candidate in queued or await self.store.label_owner(candidate) is not None:
            candidate, n = f"g{number}.{n}", n + 1
        return candidate

    async def _next_number(self) -> int:
        declared = await self.store.newest_declared()
        numbers = self.pending.generations() + ([] if declared is None else [declared])
        return max(numbers, default=-1) + 1

    async def get(self, update_id: str) -> UpdateRecord:
        """A live update's record, else the stored one (``NotFound`` if unknown)."""
        return self.pending.record(update_id) or await self.store.update(update_id)

    async def list(self, limit: int = 100) -> list[UpdateRecord]:
        return await self.store.updates(limit)

    async def _worker(self) -> None:
        while True:
            update = await self.pending.take()
            rec = update.record
            try:
                newer = self.pending.newest_queued_after(update)
                if self.coalesce and newer is not None:
                    rec.state, rec.finished_ms = UpdateState.SUPERSEDED, now_ms()
                    rec.error = f"superseded by g{newer}"
                    await self.records.save(rec)
                    continue
                if not await self.records.holding():  # e.g. Redis was away past the lease TTL
                    raise StaleFencingToken("the updater lease is not held")
                await self._roll(rec, update.target)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the update fails; the worker keeps going
                log.exception("update %s failed", rec.id)
                rec.state, rec.error, rec.finished_ms = UpdateState.FAILED, str(e), now_ms()
                await self.records.save(rec)
            finally:
                self.pending.finish(update)

    async def _roll(self, rec: UpdateRecord, target: UpdateTarget) -> None:
        """Roll ``target`` out over the pool (see :mod:`updater.plan`). The record is saved as
        it progresses through a :class:`~updater.pending.RecordSaver`, and once at the end."""
        gen_rec = GenerationRecord(
            generation=target.generation,
            identity=target.identity,
            checkpoint=str(target.path),
            probe_prompt=target.probe.prompt_token_ids,
            probe_expected=target.probe.expected,
            adapter=(adapter_name(target.generation) or "") if self.lora is not None else "",
        )
        await self.store.declare_generation(gen_rec, self.lease.require())
        rec.state, rec.started_ms = UpdateState.RUNNING, now_ms()
        await self.records.save(rec)
        saver = self._savers[rec.id] = RecordSaver(rec, self.records.save)
        try:
            if self.lora is not None:
                await self.lora.roll(rec, gen_rec)
            else:
                await self._roll_replicas(rec, target, saver)
        finally:
            del self._savers[rec.id]
            await saver.close()
        if rec.state is not UpdateState.FAILED:  # else the roll failed it (and counted it)
            ok = rec.published_ms is not None and not rec.error
            rec.state = UpdateState.SUCCEEDED if ok else UpdateState.FAILED
            rec.finished_ms = now_ms()
            self._count("succeeded" if ok else "failed")
            if self.metrics is not None and rec.staleness_window_s is not None:
                self.metrics.staleness_window.observe(rec.staleness_window_s)
        await self.records.save(rec)  # the end, whichever it is: the saver may hold none of it

    async def _roll_replicas(
        self, rec: UpdateRecord, target: UpdateTarget, saver: RecordSaver
    ) -> None:
        """The rolling loop of :meth:`_roll`: batches by the plan until every replica is on
        ``target`` (or none is left). Before the generation is published, only the first wave
        (``first_wave`` replicas) updates; once one of it failed, the update fails here
        (``rec.state`` FAILED) when the rest of it is back and none published. Each replica is
        tried once; a first-wave member that failed (while another one published) is waited for
        while RECOVERING and tried again if left on an older generation (its recovery read the
        latest before the publish). Cancelled (the updater stops), it cancels and awaits the
        cycles it started: a cycle cut off in a step leaves its replica to the next updater."""
        running: dict[str, asyncio.Task[ReplicaReport]] = {}
        try:
            await self._roll_batches(rec, target, saver, running)
        finally:  # cancelled (the updater stops): its cycles go with it, none runs on alone
            for t in running.values():
                t.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)

    async def _roll_batches(
        self,
        rec: UpdateRecord,
        target: UpdateTarget,
        saver: RecordSaver,
        running: dict[str, asyncio.Task[ReplicaReport]],
    ) -> None:
        s = self.settings
        attempted: set[str] = set()
        first: set[str] = set()  # started before the publish: the first wave
        early: set[str] = set()  # of it, those that failed: each may be tried again once
        retried: set[str] = set()
        refusal: str | None = None  # the first replica that failed before the publish, and why
        while True:
            records = await self.runner.retrying(self.store.replicas)
            latest = await self.runner.retrying(self.store.latest)
            published = latest is not None and latest[0].number >= target.generation.number
            if published and rec.published_ms is None:
                rec.published_ms = now_ms()
            if refusal is not None and not published and not running:
                rec.error = refusal  # every replica of the first wave is back, none published
                rec.state, rec.finished_ms = UpdateState.FAILED, now_ms()
                self._count("failed")
                return
            again = early - retried if published else set()
            waiting = any(r.replica_id in again and r.state is S.RECOVERING for r in records)
            if not running and not waiting and plan.done(records, target.generation.number):
                rec.rolled_ms = now_ms()
                rec.staleness_window_s = (rec.rolled_ms - rec.created_ms) / 1000
                break
            # before the publish, the first wave only: it must prove the generation; once one
            # of it failed, no other replica tries the generation until another one proves it
            limit = s.max_unavailable if published else s.first_wave if refusal is None else 0
            room = limit - len(running)
            batch = [] if room <= 0 else plan.next_batch(
                records,
                target.generation.number,
                None if latest is None else latest[0].number,
                max_unavailable=room,
                min_serving=s.min_serving,
                max_staleness=s.max_staleness,
                exclude=attempted - again,
            )  # fmt: skip
            if len(batch) > 1:  # one wave: a transport may send it one copy for all
                self.runner.expect_wave([self.replicas[rid].handle for rid in batch])
            for rid in batch:
                if rid in attempted:
                    retried.add(rid)
                if not published:
                    first.add(rid)
                attempted.add(rid)
                running[rid] = asyncio.create_task(self._cycle(self.replicas[rid], target, rec))
            if not running:  # so no batch either
                if not waiting:
                    rec.error = "no replica left to update (tainted or refused)"
                    break
                await asyncio.sleep(0.25)
                continue
            done, _ = await asyncio.wait(
                running.values(), timeout=0.25, return_when=asyncio.FIRST_COMPLETED
            )
            for rid in [rid for rid, task in running.items() if task in done]:
                report = rec.replicas[rid] = running.pop(rid).result()
                saver.changed()
                if report.outcome is not ReplicaOutcome.READY and rid in first:
                    early.add(rid)
                if report.outcome is not ReplicaOutcome.READY and refusal is None:
                    refusal = f"{rid}: {report.outcome}: {report.reason}"

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.updates.labels(result).inc()

    async def _cycle(
        self, m: ManagedReplica, target: UpdateTarget, rec: UpdateRecord
    ) -> ReplicaReport:
        async def progress(report: ReplicaReport) -> None:
            rec.replicas[m.id] = report
            saver = self._savers.get(rec.id)
            if saver is not None:  # None once the update ended (a cycle it left still reports)
                saver.changed()

        async with m.lock:
            try:
                report = await self.runner.run(m.handle, target, progress)
            except CycleError as e:
                report = e.report
            except RolloutPoolError as e:  # a lost CAS etc.: nothing more to do on it here
                report = ReplicaReport(
                    replica=m.id,
                    generation=target.generation.number,
                    outcome=ReplicaOutcome.FAILED,
                    reason=str(e),
                )
        if self.metrics is not None:
            for phase, secs in report.phases.items():
                self.metrics.phase_seconds.labels(phase).observe(secs)
            if report.outcome is ReplicaOutcome.TAINTED:
                self.metrics.taints.labels(m.id).inc()
        return report


__all__ = ["Updater"]
