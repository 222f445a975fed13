"""The replicas one updater manages, and bringing one up on a declared generation.

A :class:`ManagedReplica` pairs the configuration with the cycle runner's
:class:`~updater.cycle.ReplicaHandle` (engine client, manifest, controller state), the local
launcher where the updater starts the process itself, and the supervisor's bookkeeping. Its
``lock`` is held by whoever drives the replica (an update cycle, a join, a recovery), so two of
them never overlap on one replica.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from pool.launcher import LocalReplica
from pool.records import ReplicaReport
from pool.types import GenerationRecord
from updater.cycle import CycleRunner, Probe, ReplicaHandle
from updater.settings import ReplicaConfig


@dataclass
class ManagedReplica:
    config: ReplicaConfig
    handle: ReplicaHandle
    launcher: LocalReplica | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    misses: int = 0  # consecutive failed health checks
    recovering: asyncio.Task[None] | None = None
    quarantined: bool = False  # tainted and its bindings aborted; waiting for recovery

    @property
    def id(self) -> str:
        return self.config.id


async def bring_up(
    runner: CycleRunner, m: ManagedReplica, gen: GenerationRecord, *, from_scratch: bool
) -> ReplicaReport:
    """Bootstrap ``m`` (UNINITIALIZED or RECOVERING, engine not serving) to READY on ``gen``:
    load ``gen``'s checkpoint, reset, validate, commit. Without ``from_scratch`` (a replica's
    first join only) the load is skipped when the process was started on that checkpoint;
    recovery always loads (I6). Raises :class:`~updater.cycle.CycleError` (the replica is then
    TAINTED). The caller holds ``m.lock``."""
    started_on = (m.config.launch.model if m.config.launch else m.config.model).resolve()
    same = Path(gen.checkpoint) == started_on
    checkpoint = None if same and not from_scratch else Path(gen.checkpoint)
    probe = Probe(gen.probe_prompt, gen.probe_expected)
    return await runner.bootstrap(m.handle, gen.generation, gen.identity, probe, checkpoint)


__all__ = ["ManagedReplica", "bring_up"]
