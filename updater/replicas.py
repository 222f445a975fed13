"""The replicas one updater manages, and bringing one up on a declared generation.

A :class:`ManagedReplica` pairs the configuration with the cycle runner's
:class:`~updater.handle.ReplicaHandle` (engine client, manifest, controller state, the provider's
identity of its process) and the supervisor's bookkeeping. Its process is started, restarted and
located by the pool's :class:`~updater.providers.base.ReplicaProvider`. Its ``lock`` is held by
whoever drives the replica (an update cycle, a join, a recovery), so two of them never overlap
on one replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pool.engine import VllmEngine
from pool.records import ReplicaReport
from pool.types import GenerationRecord
from updater.config import ReplicaConfig
from updater.cycle import CycleRunner, Probe, ReplicaHandle

#: The engine URL of a replica whose provider decides its URL only when it is placed (Ray):
#: ``.invalid`` never resolves (RFC 2606), so a call before placement fails at once.
UNPLACED_URL = "http://unplaced.invalid"


@dataclass
class ManagedReplica:
    config: ReplicaConfig
    handle: ReplicaHandle
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    misses: int = 0  # consecutive failed health checks
    recovering: asyncio.Task[None] | None = None
    quarantined: bool = False  # tainted and its bindings aborted; waiting for recovery
    cause: str = ""  # why it was quarantined (kept while recovery attempts fail)
    restarts: int = 0  # fresh processes its provider started for it (restart_fresh)

    @property
    def id(self) -> str:
        return self.config.id

    async def move_to(self, url: str) -> bool:
        """Point the engine client at ``url`` (a fresh client; the old one is closed). Returns
        False, doing nothing, if it already points there. The caller holds ``lock`` or no one
        drives the replica yet."""
        old = self.handle.engine
        if url.rstrip("/") == old.url:
            return False
        self.handle.engine = VllmEngine(url, timeout=old.timeout)
        await old.aclose()
        return True


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


class Join(Protocol):
    """How a fresh process is brought up on a generation (:func:`bring_up`'s signature)."""

    def __call__(
        self, m: ManagedReplica, gen: GenerationRecord, *, from_scratch: bool
    ) -> Awaitable[object]: ...


__all__ = ["UNPLACED_URL", "Join", "ManagedReplica", "bring_up"]
