"""The transport contract: preflight (never mutates), then transfer (mutates).

The cycle runner calls, for one replica that is already QUIESCED (engine paused, no bindings):

1. :meth:`Transport.preflight` — checks that ``target`` can be applied to this replica: the
   checkpoint exists and is readable, its manifest matches the replica's, the declared identity
   matches the checkpoint. It **must not mutate** the engine (read-only calls at most). Refusal
   raises :class:`~pool.errors.PreflightFailed`; the replica can be resumed on its old weights.
2. :meth:`Transport.transfer` — loads the new weights. It returns
   :class:`~pool.evidence.TransferEvidence` on success. It may raise
   :class:`~pool.errors.PreflightFailed` or :class:`~pool.errors.NoMutation` only when nothing
   was changed. **Any other exception from transfer is ambiguous**: the caller must treat the
   replica's weights as unknown (``StepFailed(AMBIGUOUS)`` -> TAINTED), including
   ``CancelledError`` and deadline expiry.

Transports do not pause, reset caches, set labels or validate; the cycle runner does. One
instance serves a whole pool: per-replica state (e.g. an NCCL group) is keyed by the replica's
URL and dropped by :meth:`Transport.forget`; concurrency control (one replica at a time) belongs
to the caller.

The target check every transport runs in preflight is :mod:`updater.transports.preflight`;
transports are built by name through :mod:`updater.transports.registry`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, Self

from pool.engine import VllmEngine
from pool.evidence import TransferEvidence
from pool.types import Manifest, WeightIdentity

if TYPE_CHECKING:
    from updater.transports.nccl.config import NcclConfig

__all__ = ["Transport", "TransportSettings", "WeightsTarget"]


class TransportSettings(Protocol):
    """The sections of the updater's settings a transport is built from: its name and the
    transports' own settings. :class:`updater.settings.UpdaterSettings` has them; a transport
    never sees the rest."""

    transport: str
    checksums: bool
    nccl: NcclConfig


@dataclass(frozen=True)
class WeightsTarget:
    """The weights to load into one replica, as every transport sees them.

    ``identity`` is what the trainer declared; ``path`` the absolute checkpoint directory (the
    reload transport and NCCL service mode read it; an in-process NCCL source ignores it);
    ``expected_manifest`` the manifest of the model the replica was started with (recorded at
    bootstrap): the new weights must match it exactly (names, shapes, dtypes).
    """

    identity: WeightIdentity
    path: Path
    expected_manifest: Manifest


class Transport(ABC):
    """Moves the weights described by a :class:`WeightsTarget` into one engine. See the module
    contract."""

    #: Registry name, recorded in :attr:`TransferEvidence.transport`.
    name: ClassVar[str]

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """The transport the updater's settings describe (what the registry builds). By default
        one with its defaults; a transport with settings of its own overrides this."""
        return cls()

    @abstractmethod
    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Refuse ``target`` with PreflightFailed unless it can be applied. Never mutates."""

    def forget(self, url: str) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Drop per-replica state (e.g. an NCCL group) after the replica at ``url`` restarted."""

    def expect_wave(self, urls: Collection[str]) -> None:  # noqa: B027 - optional hook
        """The caller is about to update the replicas at ``urls`` concurrently to one target
        (a wave of the rolling plan); each cycle still calls :meth:`transfer` on its own. A
        transport that can send one copy to several replicas may gather those transfers
        (``nccl_direct``); by default this is ignored."""

    @abstractmethod
    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """Load ``target`` into ``engine`` (paused). Exceptions other than PreflightFailed /
        NoMutation mean the engine's weights are unknown."""
