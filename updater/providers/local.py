"""``local``: the updater runs each replica as a local process group (:class:`LocalReplica`).

What the updater did before providers existed, unchanged: ``start`` launches the server and
waits for a real completion; ``restart_fresh`` SIGKILLs the whole group (a hung or SIGSTOPped
server too) and starts a new one on the same port and work dir, so the replica keeps its URL;
``stop`` SIGTERMs the group, then SIGKILLs it. A replica's ``url`` (e.g. a proxy in front of the
server) wins over the launcher's. The incarnation is the server's pid with its start time
(``/proc/<pid>/stat``) and the host's name, so a recycled pid is never mistaken for the old
process.

The processes belong to the updater that launched them and end with it: each group is on a
:mod:`leash <updater.providers.leash>` that SIGKILLs it once that updater's process is gone (a
crash leaves no orphan serving, or holding the cores a new updater's starts need). A group an
updater left running on this host (it was stopped, e.g. SIGSTOP, and fenced out) is found by
its recorded incarnation and ended by the next updater (:meth:`LocalProvider.reclaim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from typing import Self

from pool.launcher import LaunchError, LocalReplica
from updater.config import ReplicaConfig
from updater.providers.base import Location, ProviderError, ProviderSettings, ReplicaProvider
from updater.providers.leash import Leash, attach, runs, start_ticks

__all__ = ["LocalProvider"]


class LocalProvider(ReplicaProvider):
    """One :class:`LocalReplica` per replica (see the module docstring)."""

    name = "local"
    launches = True
    can_restart = True

    def __init__(self, replicas: list[ReplicaConfig]) -> None:
        self._configs = {r.id: r for r in replicas}
        self._launchers: dict[str, LocalReplica] = {}
        self._leashes: dict[str, Leash] = {}
        self._host = socket.gethostname()
        for r in replicas:
            if r.launch is None:
                raise ValueError(f"replica {r.id}: the local provider needs a launch spec")
            self._launchers[r.id] = LocalReplica(r.launch)

    @classmethod
    def from_settings(cls, settings: ProviderSettings) -> Self:
        return cls(settings.replicas)

    def launcher(self, replica_id: str) -> LocalReplica:
        """The replica's launcher (tests and benchmarks signal its process group directly)."""
        return self._launchers[replica_id]

    def url(self, replica_id: str) -> str:
        return self._configs[replica_id].url or self._launchers[replica_id].url

    def _location(self, replica_id: str) -> Location:
        spec = self._launchers[replica_id].spec
        return Location(self.url(replica_id), spec.host, socket.gethostname())

    async def _launch(self, replica_id: str, restart: bool) -> Location:
        """Start (``restart``: stop, then start) the replica's group on a leash (see the
        module docstring)."""
        launcher = self._launchers[replica_id]
        if restart:
            launcher.spawned.clear()
        task = asyncio.create_task(launcher.restart() if restart else launcher.start())
        spawned = asyncio.create_task(launcher.spawned.wait())
        await asyncio.wait({task, spawned}, return_when=asyncio.FIRST_COMPLETED)
        spawned.cancel()
        self._unleash(replica_id)
        if launcher.spawned.is_set() and launcher.pid is not None and not task.done():
            self._leashes[replica_id] = await asyncio.to_thread(attach, launcher.pid)
        try:
            await task
        except LaunchError as e:
            self._unleash(replica_id)
            raise ProviderError(e.message, replica=replica_id, provider=self.name) from e
        return self._location(replica_id)

    def _unleash(self, replica_id: str) -> None:
        leash = self._leashes.pop(replica_id, None)
        if leash is not None:
            leash.cut()

    async def start(self, replica_id: str) -> Location:
        return await self._launch(replica_id, restart=False)

    async def stop(self, replica_id: str) -> None:
        await self._launchers[replica_id].stop()
        self._unleash(replica_id)

    async def restart_fresh(self, replica_id: str) -> Location:
        self._launchers[replica_id].kill(signal.SIGKILL)  # a hung (SIGSTOPped) server too
        return await self._launch(replica_id, restart=True)

    async def locate(self, replica_id: str) -> Location:
        return self._location(replica_id)

    async def incarnation(self, replica_id: str) -> str | None:
        pid = self._launchers[replica_id].pid
        started = start_ticks(pid) if pid is not None else None
        return None if started is None else f"pid:{pid}@{started}@{self._host}"

    def _left_over(self, incarnation: str) -> int | None:
        """The pid of the group ``incarnation`` names, if it runs on this host, is not one of
        this provider's own, and is the very process recorded (start time)."""
        kind, _, rest = incarnation.partition(":")
        pid_s, _, rest = rest.partition("@")
        started, _, host = rest.partition("@")
        if kind != "pid" or host != self._host or not pid_s.isdigit() or not started.isdigit():
            return None
        pid = int(pid_s)
        if any(r.pid == pid for r in self._launchers.values()):
            return None
        return pid if runs(pid, int(started)) else None

    async def reclaimable(self, replica_id: str, incarnation: str) -> bool:
        return self._left_over(incarnation) is not None

    async def reclaim(self, replica_id: str, incarnation: str, wait_s: float = 30.0) -> None:
        """SIGKILL the left-over group (its leader is the recorded pid: each group is its own
        session) and wait until it is gone."""
        pid = self._left_over(incarnation)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._left_over(incarnation) is None:
                return
            await asyncio.sleep(0.1)

    async def alive(self, replica_id: str) -> bool:
        return self._launchers[replica_id].alive
