"""The replica-provider port: who runs a pool's replica processes, where, and how one is replaced.

The updater starts, stops, restarts and locates replicas only through one
:class:`ReplicaProvider` per pool, named by ``UpdaterSettings.provider`` (see
:mod:`updater.providers.registry`). The built-in adapters:

==============  ==============================  ==========================  =====================
provider        the processes are run by        ``restart_fresh``           ``incarnation``
==============  ==============================  ==========================  =====================
``local``       the updater: one process group  kill the group, start it    ``pid:<pid>@<start>``
                per replica (LocalReplica)      again on the same port      ``@<host>``
``external``    someone else, reached by URL    cannot: the supervisor      None
                (compose, a hand-run server)    waits for an orchestrator
``ray``         one Ray actor per replica that  kill the actor, create a    ``ray-actor:<id>/...``
                owns the server process         new one (maybe elsewhere)
``kubernetes``  a StatefulSet's pods            delete the pod, wait for    ``pod:<uid>/...``
                                                its successor (new UID)
==============  ==============================  ==========================  =====================

Calling contract (what every adapter may rely on, and must provide):

* **Who calls, when.** The updater calls :meth:`~ReplicaProvider.start` once per replica before
  it joins them, and :meth:`~ReplicaProvider.stop` when it stops (both concurrently across
  replicas); the supervisor calls :meth:`~ReplicaProvider.restart_fresh` while recovering a
  TAINTED replica, holding that replica's lock. So for one replica, ``start``, ``stop`` and
  ``restart_fresh`` never overlap; calls for different replicas may run concurrently.
  :meth:`~ReplicaProvider.locate`, :meth:`~ReplicaProvider.incarnation` and
  :meth:`~ReplicaProvider.alive` only read and may run at any time, concurrently with anything.
* **What blocks.** ``start`` and ``restart_fresh`` return only once the replica's server answers
  (local and Ray: a real completion; Kubernetes: the pod is Ready) or the provider's deadline
  passed; they return the replica's :class:`Location`. The read-only calls are bounded by the
  provider's own (short) deadlines.
* **What a failure leaves behind.** ``start`` and ``restart_fresh`` raise :class:`ProviderError`
  (its message becomes the replica's TAINTED reason, so it says what would fix it) and leave
  nothing of the failed attempt running: a process group is killed, an actor is killed (a pod
  belongs to its StatefulSet and is left to it). A *cancelled* ``start``/``restart_fresh`` may
  leave its attempt running; the next ``stop`` or ``restart_fresh`` of that replica ends it.
  ``stop`` is idempotent and does not raise for a replica that is already gone; adapters that do
  not launch processes (:attr:`~ReplicaProvider.launches` False) leave the replica running.
* **Evidence of a fresh process (I6).** ``incarnation`` is read live (``/proc``, an actor call, a
  pod read) and names the process the provider runs for the replica *now*; once
  ``restart_fresh`` has returned it differs from every earlier one. Recovery commits a replica
  READY only when this identity *and* the engine's own process identity both differ from the
  tainted process's (:class:`pool.evidence.ProcessIdentity`), and the latest generation was
  loaded from scratch; that check is the lifecycle controller's, for every provider.
* ``alive`` is False only when the provider *knows* the process is gone (its group exited, its
  actor is dead, its pod was deleted or is not running); None when it cannot tell (no such
  knowledge, or its control plane did not answer in time): health checks decide then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, Self

from pool.errors import RolloutPoolError

if TYPE_CHECKING:
    from updater.config import ReplicaConfig
    from updater.providers.config import KubernetesConfig, RayConfig

__all__ = ["Location", "PlacementError", "ProviderError", "ProviderSettings", "ReplicaProvider"]


class ProviderSettings(Protocol):
    """The sections of the updater's settings a provider is built from: the replicas and the
    provider's own section (``ray``, ``kubernetes``). :class:`updater.settings.UpdaterSettings`
    has them; a provider never sees the rest."""

    provider: str
    replicas: list[ReplicaConfig]
    ray: RayConfig
    kubernetes: KubernetesConfig


class ProviderError(RolloutPoolError):
    """A provider could not start, restart or reach a replica. The message says why, in words fit
    for the replica's TAINTED reason; ``context`` has ``replica`` and ``provider``."""

    code = "provider_error"


class PlacementError(ProviderError):
    """No node can host the replica now (its resource request cannot be met, or its node is
    gone); nothing was left running. Retrying later may succeed once resources free up."""

    code = "placement_error"


@dataclass(frozen=True)
class Location:
    """Where a replica's server runs now.

    ``url`` is its HTTP base URL: the updater's engine client and the routers (through the store)
    use it. ``node_address`` is the address of the node that runs the replica's processes: its
    worker processes connect *from* there to a weight sender's NCCL rendezvous, so
    ``nccl.master_address`` must be reachable from it. ``node`` is the provider's name for that
    node (a hostname, a Ray node id, a Kubernetes node name), for logs and the pool view.
    """

    url: str
    node_address: str
    node: str = ""


class ReplicaProvider(ABC):
    """Starts, stops, restarts and locates the replicas of one pool. See the module contract.

    An adapter is built once per updater from its settings (:meth:`from_settings`; no I/O),
    keeps its own per-replica state keyed by replica id, and is used from one event loop.
    """

    #: Registered name (``UpdaterSettings.provider``).
    name: ClassVar[str]
    #: The updater starts and stops the processes itself (local, Ray). Otherwise someone else
    #: runs them and :meth:`stop` leaves them running (external, Kubernetes).
    launches: ClassVar[bool]
    #: :meth:`restart_fresh` can replace a replica's process. Otherwise a TAINTED replica waits
    #: until its orchestrator replaces it (the supervisor watches for a new process).
    can_restart: ClassVar[bool]
    #: Another updater's :meth:`start` adopts the processes this one launched (Ray's named
    #: actors), so an updater that lost the lease must leave them running. False: each updater
    #: launches its own, and ends them when it stops, lease or not.
    adopts: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: ProviderSettings) -> Self:
        """Build the provider for ``settings.replicas`` (validated for this provider); no I/O."""

    @abstractmethod
    def url(self, replica_id: str) -> str | None:
        """The replica's URL as far as it is known without I/O: the configured or last located
        one; None before the first :meth:`start` where only placement decides it (Ray)."""

    @abstractmethod
    async def start(self, replica_id: str) -> Location:
        """Make the replica serve (launch it, adopt it, or wait for it) and locate it."""

    @abstractmethod
    async def stop(self, replica_id: str) -> None:
        """Stop a process this provider launched (idempotent); a no-op where it launches none."""

    @abstractmethod
    async def restart_fresh(self, replica_id: str) -> Location:
        """Replace the replica's process by a new one (the old one is ended first, never reused)
        and locate it. :class:`ProviderError` where the provider cannot restart."""

    @abstractmethod
    async def locate(self, replica_id: str) -> Location:
        """Where the replica serves now. :class:`ProviderError` if that cannot be told."""

    @abstractmethod
    async def incarnation(self, replica_id: str) -> str | None:
        """The provider's identity of the process it runs for the replica now (read live)."""

    @abstractmethod
    async def alive(self, replica_id: str) -> bool | None:
        """False: known gone; True: known running; None: cannot tell (health checks decide)."""

    async def reclaimable(self, replica_id: str, incarnation: str) -> bool:
        """Whether ``incarnation`` (an identity this kind of provider gave a process earlier,
        e.g. by an updater that crashed) names a process that still runs and that
        :meth:`reclaim` can end. Default: never (the provider adopts, or cannot tell)."""
        return False

    async def reclaim(self, replica_id: str, incarnation: str) -> None:
        """End the process ``incarnation`` names, left by an earlier updater, so it neither
        serves on unvalidated terms nor holds the resources a fresh start needs. Only called
        after :meth:`reclaimable` said True."""
        return None

    async def close(self) -> None:
        """Release the provider's own resources (API clients, a Ray connection); replicas are
        not touched. Idempotent."""
        return None
