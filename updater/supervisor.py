"""Health supervision and recovery of the replicas one updater manages (I4, I6).

Every ``health_interval_s`` the :class:`Supervisor` checks each replica that no cycle or
recovery holds (its ``lock`` is free):

* TAINTED in the store (a router's violation check, an admin) or in the controller → quarantine
  (taint, abort its active bindings with a reason) and recover;
* found mid-update with no cycle running (a step cut off, e.g. by a Redis outage) → its engine
  state is unknown: taint and recover;
* its store record disagrees with the controller (state, or generation when READY) with no
  cycle running: a transition the controller made was lost (a Redis failover) → taint and
  recover, since neither side can be trusted;
* READY: the provider does not know its process to be gone
  (:meth:`~updater.providers.base.ReplicaProvider.alive`) and ``/health`` answers within
  ``health_timeout_s``; after ``health_failures`` misses in a row, or a process known gone, →
  quarantine and recover. A healthy one must also still be the process that was validated
  (the engine's process identity): one replaced since (restarted faster than the health
  checks notice) → quarantine and recover.

Recovery (``settings.recover``, I6) needs a *new server process*. Where the pool's provider can
restart replicas (local processes, Ray actors, Kubernetes pods), it replaces the process
(:meth:`~updater.providers.base.ReplicaProvider.restart_fresh`; the replica may come back at
another URL, which the store then gets). Where it cannot (a replica someone else runs), the
replica stays TAINTED, its reason saying that it waits for its orchestrator to restart it, until
the engine reports a process identity (:attr:`pool.engine.EngineMetrics.process`) other than the
tainted one. A slow or failed ``/health`` is never such evidence. Either way the latest
generation is then loaded from scratch (even when the process was started on it) and validated
before it is READY again, and the lifecycle controller refuses the commit unless the engine's
process identity *and* the provider's (:class:`pool.evidence.ProcessIdentity`) are new and the
weights were loaded.

Each round reads the store's records only when the pool view's version moved
(:meth:`pool.store.feed.PoolWatch.versioned`: one read in an idle pool, whatever its size); a
record that disagrees with the controller is read again before anything is done about it.
Checks of different replicas run concurrently; recoveries run as their own tasks (at most one per
replica). A failed recovery leaves the replica TAINTED, its reason saying what failed (e.g. that
no node has the resources for it); the next check tries again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from pool.errors import EngineError, RolloutPoolError, raise_if_cancelling
from pool.evidence import GONE, ProcessIdentity
from pool.lifecycle import IN_UPDATE
from pool.metrics import UpdaterMetrics
from pool.store import RedisStore
from pool.store.feed import PoolWatch
from pool.types import ReplicaRecord, ReplicaState
from updater.cycle import CycleRunner
from updater.providers.base import ReplicaProvider
from updater.replicas import Join, ManagedReplica, bring_up
from updater.settings import UpdaterSettings

log = logging.getLogger(__name__)
S = ReplicaState
#: States only a running cycle or recovery may hold: found there with none, a replica is orphaned.
ORPHANABLE = IN_UPDATE | {S.RECOVERING, S.UNINITIALIZED}
WAITING_FOR_RESTART = (
    "waiting for a new server process: restart this replica through its orchestrator "
    "(e.g. delete its pod); the updater cannot restart a replica it did not launch"
)


def _agrees(m: ManagedReplica, rec: ReplicaRecord) -> bool:
    """Whether the store's record matches the controller (state; generation when READY)."""
    lc = m.handle.lc
    if rec.state is not lc.state:
        return False
    return lc.state is not S.READY or (
        lc.generation is not None and rec.generation == lc.generation.number
    )


class Supervisor:
    """See the module docstring. Not thread-safe; one event loop."""

    def __init__(
        self,
        settings: UpdaterSettings,
        store: RedisStore,
        runner: CycleRunner,
        replicas: Mapping[str, ManagedReplica],
        provider: ReplicaProvider,
        metrics: UpdaterMetrics | None = None,
        join: Join | None = None,
    ) -> None:
        self.settings = settings
        #: Brings a fresh process up on a generation: :func:`updater.replicas.bring_up`, or in a
        #: LoRA pool :meth:`updater.lora.LoraRollout.bring_up` (the base, then the adapters).
        self.join: Join = join or functools.partial(bring_up, runner)
        self.store = store
        self.runner = runner
        self.replicas = replicas
        self.provider = provider
        self.metrics = metrics
        #: the records, re-read in full only when the pool view's version moved
        self.watch = PoolWatch(store)

    async def run(self) -> None:
        """Check every replica every ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                records = dict(await self.watch.versioned())
            except RolloutPoolError as e:  # Redis away: no update step proceeds either
                raise_if_cancelling(e)  # else the updater's stop() waits on this loop forever
                log.warning("supervisor: store unavailable: %s", e)
                continue
            replicas = list(self.replicas.values())
            results = await asyncio.gather(
                *(self.check(m, records.get(m.id)) for m in replicas), return_exceptions=True
            )
            for m, res in zip(replicas, results, strict=True):
                if isinstance(res, Exception):  # e.g. Redis went away mid-check: next round
                    log.warning("supervisor: check of %s failed: %r", m.id, res)

    def cancel(self) -> None:
        """Cancel recoveries in flight (the updater is stopping)."""
        for m in self.replicas.values():
            if m.recovering is not None:
                m.recovering.cancel()

    async def check(self, m: ManagedReplica, rec: ReplicaRecord | None) -> None:
        """One check of ``m`` against its store record (see the module docstring)."""
        if m.lock.locked() or (m.recovering is not None and not m.recovering.done()):
            return
        if (rec is not None and rec.state is S.TAINTED) or m.handle.lc.state is S.TAINTED:
            reason = (rec.reason if rec is not None else "") or m.handle.lc.reason or "tainted"
            if self.provider.can_restart:
                self._start_recovery(m, reason)
            else:
                await self._watch_external(m, reason)
            return
        if m.handle.lc.state in ORPHANABLE:
            # no cycle or recovery holds it (checked above), yet it is mid-cycle: a step was
            # cut off (e.g. by a Redis outage). Its engine state is unknown: taint and recover.
            await self._orphaned(m, f"left in {m.handle.lc.state} with no cycle running")
            return
        if rec is not None and not _agrees(m, rec):
            rec = await self.store.replica(m.id)  # re-read: a cycle may have committed since
            if not m.lock.locked() and not _agrees(m, rec):
                lc = m.handle.lc
                await self._orphaned(
                    m,
                    f"the store says {rec.state} g{rec.generation}, the controller "
                    f"{lc.state} g{lc.generation.number if lc.generation else None}: "
                    "a state change was lost (Redis failover?)",
                )
                return
        if m.handle.lc.state is not S.READY:
            return
        try:  # within the health timeout: a provider that cannot tell in time does not know
            async with asyncio.timeout(self.settings.health_timeout_s):
                known = await self.provider.alive(m.id)
        except TimeoutError:
            known = None
        alive = known is not False
        healthy = alive and await m.handle.engine.health(timeout_s=self.settings.health_timeout_s)
        if healthy:
            m.misses = 0
            await self._same_process(m)
            return
        m.misses += 1
        if not alive or m.misses >= self.settings.health_failures:
            why = (
                f"its process is gone ({self.provider.name} provider)"
                if not alive
                else f"/health failed {m.misses} times"
            )
            reason = f"replica unhealthy: {why}"
            if self.provider.can_restart:
                self._start_recovery(m, reason)
            else:
                await self.quarantine(m, reason)

    async def _same_process(self, m: ManagedReplica) -> None:
        """A READY replica must still be served by the process that was validated. One its
        orchestrator replaced between two health checks (a restart faster than the checks
        notice) serves whatever it was started with, under the published generation: it is
        tainted and recovered (I6). An engine that does not answer, or reports no identity,
        is left to the health checks."""
        validated = m.handle.lc.process
        if validated is None:
            return
        try:
            now = await m.handle.engine.process_identity(timeout_s=self.settings.health_timeout_s)
        except EngineError:
            return
        if now is None or now == validated.engine:
            return
        reason = f"its server process was replaced ({validated.engine} -> {now}): not validated"
        if self.provider.can_restart:
            self._start_recovery(m, reason)
        else:
            await self.quarantine(m, reason)

    async def _watch_external(self, m: ManagedReplica, reason: str) -> None:
        """A TAINTED replica the provider cannot restart (one someone else runs): its
        orchestrator must replace the process. Once the engine (and the provider, where it has
        an identity) reports another process than the tainted one, re-join it at the latest
        generation, loaded from scratch.
        """
        if not m.quarantined:
            await self.quarantine(m, reason)
        try:
            current = await m.handle.process(self.settings.health_timeout_s)
        except EngineError:
            return  # down or slow (maybe the tainted process, stopped): no evidence either way
        if m.handle.lc.process is None:
            # the tainted process's identity was never recorded: the one answering now is it
            m.handle.lc = replace(m.handle.lc, process=current)
            return
        if current is not None and current.replaces(m.handle.lc.process):
            m.recovering = asyncio.create_task(
                self.recover(m, reason, restart=False), name=f"rejoin-{m.id}"
            )

    async def _tainted_process(self, m: ManagedReplica) -> ProcessIdentity:
        """The identity of the process a recovery replaces, read before the restart; GONE when
        no engine answers (a process that does not run cannot be the one that comes back)."""
        try:
            current = await m.handle.process(self.settings.health_timeout_s)
        except EngineError:
            current = None
        return current or ProcessIdentity(GONE)

    async def quarantine(self, m: ManagedReplica, reason: str) -> None:
        """Taint (if not yet) and abort what is bound to it; idempotent. The store's reason
        becomes ``reason``, and says what recovery waits for: where the provider cannot restart
        the replica, that its orchestrator must (:data:`WAITING_FOR_RESTART`).

        The store is tainted whatever the controller says: a cycle whose taint the store
        refused (Redis away, or not replicated, past the commit's retries) leaves the
        controller TAINTED and the record in the step it was cut off in."""
        if not self.provider.can_restart and WAITING_FOR_RESTART not in reason:
            reason = f"{reason}; {WAITING_FOR_RESTART}"
        async with m.lock:
            if not m.quarantined:
                m.cause = reason
            token = self.runner.lease.require()
            await self.store.taint(m.id, reason, source="updater", token=token)  # no-op if so
            if m.handle.lc.state is not S.TAINTED:
                m.handle.lc = replace(m.handle.lc, state=S.TAINTED, reason=reason)
                if self.metrics is not None:
                    self.metrics.taints.labels(m.id).inc()
            aborted = await self.store.abort_active(m.id, f"replica tainted: {reason}")
            await self.store.transition(
                m.id, self.runner.lease.require(), S.TAINTED, S.TAINTED, reason=reason
            )
            if not m.quarantined:
                log.warning(
                    "replica %s tainted (%s); aborted %d rollouts", m.id, reason, len(aborted)
                )
            m.quarantined = True

    async def _orphaned(self, m: ManagedReplica, reason: str) -> None:
        m.handle.lc = replace(m.handle.lc, state=S.TAINTED, reason=reason)
        await self.store.taint(m.id, reason, source="updater", token=self.runner.lease.require())
        if self.provider.can_restart:
            self._start_recovery(m, reason)
        else:
            await self.quarantine(m, reason)

    def _start_recovery(self, m: ManagedReplica, reason: str) -> None:
        m.recovering = asyncio.create_task(self.recover(m, reason), name=f"recover-{m.id}")

    async def recover(self, m: ManagedReplica, reason: str, *, restart: bool = True) -> None:
        """Taint, abort what was bound to it, have the provider start it fresh and re-join at
        the latest generation (I6). ``restart=False``: the process was already replaced by its
        orchestrator. A failure leaves it TAINTED with the cause and what failed."""
        t0 = time.monotonic()
        await self.quarantine(m, reason)
        if not self.settings.recover:
            return
        failed: str | None = None
        async with m.lock:
            m.misses = 0
            try:
                if m.handle.lc.process is None:  # the identity recovery must differ from (I6)
                    m.handle.lc = replace(m.handle.lc, process=await self._tainted_process(m))
                await self.runner.start_recovery(m.handle, reason)
                self.runner.forget(m.handle)  # a fresh process
                if restart and self.provider.can_restart:
                    location = await self.provider.restart_fresh(m.id)
                    m.restarts += 1
                    if self.metrics is not None:
                        self.metrics.restarts.labels(m.id, self.provider.name).inc()
                    if await m.move_to(location.url):  # placed elsewhere: tell the routers
                        await self.store.register_replica(
                            m.id, location.url, self.runner.lease.require(), m.config.capacity
                        )
                latest = await self.store.latest()
                assert latest is not None
                gen = await self.store.generation_record(latest[0].number)
                await self.join(m, gen, from_scratch=True)
                m.quarantined, m.cause = False, ""
                result = "succeeded"
                log.info("replica %s recovered in %.1fs", m.id, time.monotonic() - t0)
            except (RolloutPoolError, AssertionError) as e:
                result, failed = "failed", f"{m.cause or reason}; recovery failed: {e}"
                log.error("recovery of %s failed: %s", m.id, e)
            if self.metrics is not None:
                self.metrics.recoveries.labels(result).inc()
        if failed is not None:
            await self.quarantine(m, failed)  # e.g. left RECOVERING by a failed restart


__all__ = ["ORPHANABLE", "Supervisor"]
