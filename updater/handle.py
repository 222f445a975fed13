"""What a cycle runs on and towards: one replica (:class:`ReplicaHandle`) and one target
(:class:`UpdateTarget` with its validation :class:`Probe`). Shared by the cycle runner
(:mod:`updater.cycle`), its store commits (:mod:`updater.commits`), validation
(:mod:`updater.validation`) and the updater's replica bookkeeping (:mod:`updater.replicas`).

A handle is driven by one task at a time (the replica's lock, :class:`updater.replicas.
ManagedReplica`): its controller state ``lc`` is advanced only by committed moves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from pool.engine import VllmEngine
from pool.evidence import ProcessIdentity
from pool.lifecycle import Lifecycle
from pool.types import Generation, Manifest, WeightIdentity


@dataclass(frozen=True)
class Probe:
    """A validation probe: greedy output of ``prompt_token_ids`` must equal ``expected``."""

    prompt_token_ids: tuple[int, ...]
    expected: tuple[int, ...]


@dataclass(frozen=True)
class UpdateTarget:
    generation: Generation
    identity: WeightIdentity
    path: Path
    probe: Probe


@dataclass
class ReplicaHandle:
    """The updater's view of one replica: its engine client, manifest and controller state.

    ``provider_identity`` reads the identity the replica's provider gives the process it runs
    now (:meth:`updater.providers.base.ReplicaProvider.incarnation`); None where there is none.
    """

    replica_id: str
    engine: VllmEngine
    manifest: Manifest
    lc: Lifecycle = field(default_factory=Lifecycle)
    provider_identity: Callable[[], Awaitable[str | None]] | None = None

    async def process(self, timeout_s: float) -> ProcessIdentity | None:
        """The serving process's identity now: the engine's report (None if it reports none)
        with the provider's. Raises :class:`~pool.errors.EngineError` when the engine does not
        answer within ``timeout_s``."""
        engine = await self.engine.process_identity(timeout_s=timeout_s)
        if engine is None:
            return None
        provider = await self.provider_identity() if self.provider_identity else None
        return ProcessIdentity(engine, provider)
