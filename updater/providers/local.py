"""``local``: the updater runs each replica as a local process group (:class:`LocalReplica`).

What the updater did before providers existed, unchanged: ``start`` launches the server and
waits for a real completion; ``restart_fresh`` SIGKILLs the whole group (a hung or SIGSTOPped
server too) and starts a new one on the same port and work dir, so the replica keeps its URL;
``stop`` SIGTERMs the group, then SIGKILLs it. A replica's ``url`` (e.g. a proxy in front of the
server) wins over the launcher's. The incarnation is the server's pid with its start time
(``/proc/<pid>/stat``), so a recycled pid is never mistaken for the old process.
"""

from __future__ import annotations

import signal
import socket
from typing import Self

from pool.launcher import LaunchError, LocalReplica
from updater.providers.base import Location, ProviderError, ReplicaProvider
from updater.providers.leash import start_ticks
from updater.settings import ReplicaConfig, UpdaterSettings

__all__ = ["LocalProvider"]


class LocalProvider(ReplicaProvider):
    """One :class:`LocalReplica` per replica (see the module docstring)."""

    name = "local"
    launches = True
    can_restart = True

    def __init__(self, replicas: list[ReplicaConfig]) -> None:
        self._configs = {r.id: r for r in replicas}
        self._launchers: dict[str, LocalReplica] = {}
        for r in replicas:
            if r.launch is None:
                raise ValueError(f"replica {r.id}: the local provider needs a launch spec")
            self._launchers[r.id] = LocalReplica(r.launch)

    @classmethod
    def from_settings(cls, settings: UpdaterSettings) -> Self:
        return cls(settings.replicas)

    def launcher(self, replica_id: str) -> LocalReplica:
        """The replica's launcher (tests and benchmarks signal its process group directly)."""
        return self._launchers[replica_id]

    def url(self, replica_id: str) -> str:
        return self._configs[replica_id].url or self._launchers[replica_id].url

    def _location(self, replica_id: str) -> Location:
        spec = self._launchers[replica_id].spec
        return Location(self.url(replica_id), spec.host, socket.gethostname())

    async def start(self, replica_id: str) -> Location:
        try:
            await self._launchers[replica_id].start()
        except LaunchError as e:
            raise ProviderError(e.message, replica=replica_id, provider=self.name) from e
        return self._location(replica_id)

    async def stop(self, replica_id: str) -> None:
        await self._launchers[replica_id].stop()

    async def restart_fresh(self, replica_id: str) -> Location:
        launcher = self._launchers[replica_id]
        launcher.kill(signal.SIGKILL)  # a hung (SIGSTOPped) server is not asked to exit
        try:
            await launcher.restart()
        except LaunchError as e:
            raise ProviderError(e.message, replica=replica_id, provider=self.name) from e
        return self._location(replica_id)

    async def locate(self, replica_id: str) -> Location:
        return self._location(replica_id)

    async def incarnation(self, replica_id: str) -> str | None:
        pid = self._launchers[replica_id].pid
        started = start_ticks(pid) if pid is not None else None
        return None if started is None else f"pid:{pid}@{started}"

    async def alive(self, replica_id: str) -> bool:
        return self._launchers[replica_id].alive
