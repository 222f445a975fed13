"""LoRA generations: g+1 is loaded beside g on every replica, no drain (``generations: lora``).

The base model never changes; generation g >= 1 is a PEFT adapter served under
:func:`pool.adapters.adapter_name`, and every request names its adapter (the router writes it
from the rollout's binding), so a rollout bound to g runs on g while g+1 is loaded, validated and
admitted beside it. An update, on every READY replica at once::

    load      POST /v1/load_lora_adapter (rp-<n>-<label>, the adapter's directory)
              failed (any error answer; the name, if vLLM lists it anyway, is unloaded again)
              with the name not listed and g's own probe still passing: nothing changed, the
              replica stays READY on g and does not admit g+1
              anything else (no answer, the name still listed, g's probe failing): TAINTED
              (I4), recovered from a fresh process (I6)
    validate  the probe through the adapter (greedy, model = the adapter), the answer's
              ``model``, the process unchanged since bootstrap and, with ``lora_checksums``,
              the factors the workers hold equal to the directory's (:mod:`pool.adapter_sums`)
              -> AdapterEvidence; evidence that does not prove the adapter: it is unloaded and
              the replica judged as above
    admit     READY(g) -> READY(g+1) (fenced CAS, not published), for every replica that
              validated; then g+1 is published once (:meth:`pool.store.adapters.Adapters.publish`)

No replica stops admitting: one on g+1 is admissible while g is still the latest, and g is not
admissible only once g+1 is published. If no replica validated, nothing is published and the
update fails.

**Retiring** (:meth:`LoraRollout.retire`, after every update and every ``retire_interval_s``): an
adapter ``rp-<n>-...`` on a replica is unloaded once ``n`` is below ``latest - max_staleness``,
below the replica's own generation, and nothing on that replica holds it (no active binding, no
live router grant on it: :meth:`pool.store.adapters.Adapters.holds`); vLLM's answer is checked (200
removed, 404 already gone). Adapter slots: a replica is launched with ``max_loras`` of at least
``max_staleness + 2`` (the admissible generations, one held by a finishing rollout, the new one);
vLLM swaps more from their files if it must, slower but correct.

**Left behind**: a READY replica whose load failed, or that a recovery brought up while a newer
generation was published, is brought up to the published one by :meth:`LoraRollout.reconcile`
(every ``retire_interval_s``, once per replica and generation).

**Recovery** (I6) of a LoRA replica: a fresh process is brought up on the base model (g0's
record, loaded from scratch and validated as any bootstrap), then :meth:`LoraRollout.catch_up`
loads the live generations' adapters (``latest - max_staleness`` .. ``latest``), admitting
each in turn once validated as in an update.

Concurrency: one instance per updater; each replica's loads run under its ``ManagedReplica``
lock, so they never overlap a recovery of that replica. Retiring takes no lock
(:meth:`LoraRollout.retire` says why that is safe): an update never waits for an unload.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.adapter_sums import expected_adapter_checksums
from pool.adapters import adapter_name, served_model
from pool.checksum import Checksum, from_json
from pool.engine_adapters import load_adapter, probe_adapter, served_adapters, unload_adapter
from pool.errors import EngineError, NoMutation, NotFound, RolloutPoolError
from pool.evidence import AdapterEvidence, ChecksumEvidence
from pool.records import ReplicaOutcome, ReplicaReport, UpdateRecord
from pool.types import GenerationRecord, ReplicaState
from updater.cycle import CycleRunner
from updater.handle import ReplicaHandle
from updater.records import now_ms
from updater.replicas import ManagedReplica, bring_up
from updater.validation import worker_result

__all__ = ["LoraRollout"]

log = logging.getLogger(__name__)
S = ReplicaState
_ADAPTER = re.compile(r"^rp-(\d+)-")


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass
class _Loaded:
    """One replica's result of the load-and-validate step."""

    m: ManagedReplica
    report: ReplicaReport


class LoraRollout:
    """See the module docstring."""

    def __init__(
        self,
        runner: CycleRunner,
        replicas: dict[str, ManagedReplica],
        max_staleness: int,
        checksums: bool = False,
    ) -> None:
        self.runner = runner
        self.store = runner.store
        self.replicas = replicas
        self.max_staleness = max_staleness
        #: compare the factors the workers hold with the directory's (``lora_checksums``)
        self.checksums = checksums
        self._tried: set[tuple[str, int]] = set()  # what reconcile() already attempted
        self._dtype: str | None = None  # the served dtype the workers reported last
        #: the directory's checksums by (path, served dtype): computed once per generation,
        #: started with its update when the dtype is known (off the loads' critical path)
        self._expected: dict[tuple[str, str], asyncio.Task[dict[str, Checksum]]] = {}

    # ------------------------------------------------------------------ the update

    async def roll(self, rec: UpdateRecord, gen: GenerationRecord) -> None:
        """Load, validate and admit ``gen`` on every READY replica, then publish it (see the
        module docstring). Fills in ``rec`` (per-replica reports, published/rolled times,
        ``error`` when no replica admitted it)."""
        records = {r.replica_id: r for r in await self.runner.retrying(self.store.replicas)}
        todo = [
            m
            for m in self.replicas.values()
            if (r := records.get(m.id)) is not None
            and r.state is S.READY
            and (r.generation or 0) < gen.generation.number
        ]
        if self.checksums and self._dtype is not None:
            self._expect(gen.checkpoint, self._dtype)  # while the replicas load
        results = await asyncio.gather(*(self._load_on(m, gen) for m in todo))
        admitted = [x for x in results if x.report.outcome is ReplicaOutcome.READY]
        for x in results:
            rec.replicas[x.m.id] = x.report
        if not admitted:
            rec.error = "no replica admitted the adapter: " + "; ".join(
                f"{x.m.id}: {x.report.reason}" for x in results
            )
            return
        await self.store.adapters.publish(
            gen.generation, gen.identity.digest, self.runner.lease.require()
        )
        rec.published_ms = rec.rolled_ms = now_ms()
        rec.staleness_window_s = (rec.rolled_ms - rec.created_ms) / 1000
        await self.retire()

    async def _load_on(self, m: ManagedReplica, gen: GenerationRecord) -> _Loaded:
        report = ReplicaReport(replica=m.id, generation=gen.generation.number)
        out = _Loaded(m, report)
        t0 = time.monotonic()
        async with m.lock:
            report.phases["wait"] = time.monotonic() - t0  # another step held the replica
            if m.handle.lc.state is not S.READY:
                report.outcome, report.reason = ReplicaOutcome.FAILED, f"{m.handle.lc.state}"
                return out
            own = m.handle.lc.generation
            if own is not None and own.number >= gen.generation.number:
                # the store said otherwise before the lock was ours: a recovery's catch-up
                # has loaded and validated it since (loading it again would answer 400,
                # and the cleanup would unload what the replica serves)
                report.outcome, report.reason = ReplicaOutcome.READY, f"already on g{own.number}"
                return out
            try:
                ev = await self._load_and_validate(m.handle, gen, report)
                t0 = time.monotonic()
                await self.runner.commit(m.handle, ev, publish=False)
                report.phases["admit"] = time.monotonic() - t0
                report.outcome = ReplicaOutcome.READY
            except _Refused as e:
                report.outcome, report.reason = ReplicaOutcome.REFUSED, str(e)
            except RolloutPoolError as e:
                await self.runner._taint(m.handle, "adapter", e)  # no-op if already TAINTED
                report.outcome = ReplicaOutcome.TAINTED
                report.reason = f"{type(e).__name__}: {e}"
        return out

    async def _load_and_validate(
        self, h: ReplicaHandle, gen: GenerationRecord, report: ReplicaReport
    ) -> AdapterEvidence:
        """Load ``gen``'s adapter on ``h`` and probe through it. Raises :class:`_Refused` when
        nothing changed (the replica keeps serving its generation), another error when the
        outcome is ambiguous (the caller taints)."""
        d = self.runner.deadlines
        name = adapter_name(gen.generation)
        assert name is not None, "generation 0 is the base model, not an adapter"
        t0 = time.monotonic()
        try:
            await self.runner._engine(
                "load",
                lambda: load_adapter(h.engine, name, gen.checkpoint, timeout_s=d.transfer_s),
                d.transfer_s,
                mutating=True,
            )
        except EngineError as e:
            if name in await served_adapters(h.engine, timeout_s=d.validate_s):
                await unload_adapter(h.engine, name, timeout_s=d.transfer_s)  # never half-kept
            await self._judge_failure(h, name, f"load: {e}", refused=isinstance(e, NoMutation))
        report.phases["load"] = time.monotonic() - t0
        t0 = time.monotonic()
        probe = gen.probe_prompt
        (actual, named), process, sums = await asyncio.gather(
            self.runner._engine(
                "validate",
                lambda: probe_adapter(
                    h.engine, name, probe, len(gen.probe_expected), timeout_s=d.validate_s
                ),
                d.validate_s,
                mutating=False,
                fenced=False,
            ),
            h.process(d.resume_s),
            self._checksums(h, gen),  # beside the probe: the call waits for an engine step
        )
        report.phases["validate"] = time.monotonic() - t0
        if sums is not None:
            report.phases["checksums"] = sums.replica_s
            report.phases["checksums_expected"] = sums.sender_s
        ev = AdapterEvidence(
            generation=gen.generation,
            identity_digest=gen.identity.digest,
            adapter=name,
            listed=True,  # the load answered 200
            probe_expected=gen.probe_expected,
            probe_actual=actual,
            answered_model=named,
            process=None if process is None else process.engine,
            checksums=sums,
        )
        if not ev.proves_admissible:
            why = f"validation: probe {list(actual[:8])}, expected {list(gen.probe_expected[:8])}"
            why += f", answer named {named!r}" if named != name else ""
            why += f", checksums {sums}" if sums is not None and not sums.proves_equal else ""
            await unload_adapter(h.engine, name, timeout_s=d.transfer_s)
            await self._judge_failure(h, name, why, refused=True)
        return ev

    async def _checksums(self, h: ReplicaHandle, gen: GenerationRecord) -> ChecksumEvidence | None:
        """With ``lora_checksums`` (else None): the factors of the adapter ``h`` loaded last
        against ``gen``'s directory's (vLLM numbers adapters in load order, and only this
        updater loads any, under the replica's lock). A replica that cannot report (no worker
        extension, LoRA off, an error) or an adapter whose checksums cannot be predicted yields
        evidence with ``error`` set, which does not prove equality."""
        if not self.checksums:
            return None
        t0 = time.monotonic()
        replica_s = 0.0
        try:
            result = await worker_result(
                h, "rolloutpool_lora_checksums", self.runner.deadlines.validate_s
            )
            replica_s = time.monotonic() - t0
            held = {int(i): from_json(s) for i, s in result["adapters"].items()}
            actual = held[max(held)] if held else {}
            if not actual:
                raise ValueError("the workers hold no adapter factors")
            self._dtype = next(iter(actual.values())).dtype
            t0 = time.monotonic()
            expected = await asyncio.shield(self._expect(gen.checkpoint, self._dtype))
        except Exception as e:
            return ChecksumEvidence.compare(
                {}, {}, replica_s=replica_s, error=f"{type(e).__name__}: {e}"[:500]
            )
        sender_s = time.monotonic() - t0
        return ChecksumEvidence.compare(expected, actual, sender_s=sender_s, replica_s=replica_s)

    def _expect(self, path: str, dtype: str) -> asyncio.Task[dict[str, Checksum]]:
        """The computation of the checksums of the adapter in ``path`` served as ``dtype``
        (:func:`pool.adapter_sums.expected_adapter_checksums`, in a thread), started once; the
        last few are kept."""
        task = self._expected.get((path, dtype))
        if task is None:
            task = asyncio.create_task(
                asyncio.to_thread(expected_adapter_checksums, Path(path), dtype)
            )
            self._expected[(path, dtype)] = task
            task.add_done_callback(_retrieved)  # its error is the evidence's, if anyone awaits
            while len(self._expected) > 4:
                del self._expected[next(iter(self._expected))]
        return task

    async def _judge_failure(self, h: ReplicaHandle, name: str, why: str, *, refused: bool) -> None:
        """After a failed load or validation: raise :class:`_Refused` if the replica provably
        still serves what it served (``name`` not listed; its own generation's probe passes);
        re-raise as ambiguous otherwise."""
        d = self.runner.deadlines
        if name in await served_adapters(h.engine, timeout_s=d.validate_s):
            raise RolloutPoolError(f"{why}; and {name} is listed after the failure")
        cur = h.lc.generation
        assert cur is not None
        rec = await self.store.generation_record(cur.number)
        actual, _ = await probe_adapter(
            h.engine,
            served_model(cur, h.engine.model_id or ""),
            rec.probe_prompt,
            len(rec.probe_expected),
            timeout_s=d.validate_s,
        )
        if actual != rec.probe_expected:
            raise RolloutPoolError(f"{why}; and g{cur.number}'s own probe now fails")
        if not refused:
            log.warning("%s: %s (nothing loaded, g%d still serves)", h.replica_id, why, cur.number)
        raise _Refused(why)

    # ------------------------------------------------------------------ recovery

    async def bring_up(
        self, m: ManagedReplica, gen: GenerationRecord, *, from_scratch: bool
    ) -> None:
        """:func:`updater.replicas.bring_up` for a LoRA pool: a generation that is an adapter
        is reached by bringing the process up on the base (g0's record), then
        :meth:`catch_up`. Raises :class:`~updater.cycle.CycleError` or
        :class:`~pool.errors.RolloutPoolError` (the replica is then TAINTED)."""
        if not gen.adapter:
            await bring_up(self.runner, m, gen, from_scratch=from_scratch)
            return
        base = await self.store.generation_record(0)
        await bring_up(self.runner, m, base, from_scratch=from_scratch)
        await self.catch_up(m)

    async def catch_up(self, m: ManagedReplica) -> None:
        """``m`` is READY on the base (g0) in a fresh process: load the adapters of the live
        generations (``latest - max_staleness`` .. ``latest``), admitting each in turn. A
        failure taints it (the supervisor recovers it again). The caller holds ``m.lock``."""
        latest = await self._latest_number()
        own = m.handle.lc.generation
        first = max(1, latest - self.max_staleness, (own.number + 1) if own else 1)
        for n in range(first, latest + 1):
            try:
                gen = await self.store.generation_record(n)
            except NotFound:
                continue  # a number never declared (superseded): nothing to load
            if not gen.adapter:
                continue
            report = ReplicaReport(replica=m.id, generation=n)
            try:
                ev = await self._load_and_validate(m.handle, gen, report)
                await self.runner.commit(m.handle, ev, publish=False)
            except (RolloutPoolError, _Refused) as e:
                await self.runner._taint(m.handle, f"catch up to g{n}", e)
                raise RolloutPoolError(f"{m.id}: catching up to g{n} failed: {e}") from e

    async def reconcile(self) -> None:
        """Bring every READY replica left behind the published generation (its load failed,
        or a recovery finished on an older one) up to it, as an update would (:meth:`_load_on`:
        a refusal leaves it where it is); each (replica, generation) is tried once. Replicas
        busy with another step are skipped this round."""
        latest = await self.runner.retrying(self.store.latest)
        if latest is None or latest[0].number == 0:
            return
        number = latest[0].number
        behind = [
            self.replicas[r.replica_id]
            for r in await self.runner.retrying(self.store.replicas)
            if r.replica_id in self.replicas
            and r.state is S.READY
            and (r.generation or 0) < number
            and (r.replica_id, number) not in self._tried
            and not self.replicas[r.replica_id].lock.locked()
        ]
        if not behind:
            return
        gen = await self.store.generation_record(number)
        for m in behind:
            self._tried.add((m.id, number))
            out = await self._load_on(m, gen)
            log.info(
                "%s caught up to g%d: %s %s", m.id, number, out.report.outcome, out.report.reason
            )

    # ------------------------------------------------------------------ retiring

    async def _latest_number(self) -> int:
        latest = await self.runner.retrying(self.store.latest)
        return 0 if latest is None else latest[0].number

    async def retire(self, only: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Unload, on every READY replica (or those in ``only``), the adapters nothing needs any
        more (module docstring). Replicas busy with another step are skipped this round.
        Returns what was unloaded, by replica.

        Retiring takes no replica lock, so an update never waits for an unload: what it
        unloads is below ``latest - max_staleness`` and the replica's own generation, hence
        below every adapter an update, a catch-up or a reconcile loads (the latest or newer),
        and no new binding or grant can come to hold it (it is not admissible). An unload that
        meets a recovered process finds nothing (404)."""
        latest = await self._latest_number()
        out: dict[str, list[str]] = {}
        for rid in list(only) if only is not None else list(self.replicas):
            m = self.replicas[rid]
            if m.lock.locked():
                continue
            try:
                out[rid] = await self._retire_on(m, latest)
            except RolloutPoolError as e:
                log.warning("retiring adapters on %s: %s", rid, e)
        return out

    async def _retire_on(self, m: ManagedReplica, latest: int) -> list[str]:
        h = m.handle
        own = h.lc.generation
        if h.lc.state is not S.READY or own is None:
            return []
        d = self.runner.deadlines
        loaded = await served_adapters(h.engine, timeout_s=d.validate_s)
        stale = {
            name: int(mt[1])
            for name in loaded
            if (mt := _ADAPTER.match(name)) is not None
            and int(mt[1]) < min(own.number, latest - self.max_staleness)
        }
        if not stale:
            return []
        holds = await self.store.adapters.holds(m.id)
        if holds is None:
            return []
        gone = []
        for name, n in sorted(stale.items(), key=lambda kv: kv[1]):
            if n in holds:
                continue
            self.runner.lease.require()
            removed = await unload_adapter(h.engine, name, timeout_s=d.transfer_s)
            log.info("%s: retired %s (%s)", m.id, name, "unloaded" if removed else "was gone")
            gone.append(name)
        return gone


class _Refused(Exception):
    """Nothing changed on the replica: it keeps serving its generation and does not admit the
    new one."""
