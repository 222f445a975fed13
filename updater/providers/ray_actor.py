"""The code that runs on the Ray cluster: one actor per replica, owning one vLLM server process.

:class:`ReplicaActor` is created by :class:`updater.providers.ray.RayProvider` with
``max_restarts=0``: an actor never comes back by itself, and it never restarts its server
either. A fresh process is a new actor (a new actor id), which is what the provider reports as
the replica's incarnation. On its node the actor:

* binds the server to the node's address (``ray.util.get_node_ip_address``) on a free port, and
  takes its CPU cores from the node's environment where that is set (``cpu_bind_env``, e.g.
  ``ray start`` run with ``ROLLOUTPOOL_CPU_BIND="0-3;4-7"``: ``;`` separates the core sets of
  the replicas the node can host; the actor claims the first one no other replica of this host
  holds, :func:`claim_cores`), else from the spec. vLLM's CPU worker spins on its cores: two
  replicas on one core starve each other (a start there was seen to make no progress at all);
* starts it with :class:`pool.launcher.LocalReplica` (the same start as the local provider:
  ready only after a real completion, a failed start leaves nothing running) and puts a
  :mod:`leash <updater.providers.leash>` on its process group, so the server dies with the actor;
* answers ``identity`` / ``alive`` from its event loop while a start is in progress.

Methods run in the actor's event loop (an async actor); ``start`` and ``stop`` are called at most
once each, in that order, by the provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Any

import ray

from pool.launcher import LaunchError, LocalReplica, ReplicaSpec
from updater.providers.leash import Leash, attach, start_ticks

__all__ = ["ReplicaActor", "claim_cores"]

#: Host-wide locks of the core sets replicas hold (one file per core set, held by the actor).
CORE_LOCKS = Path(tempfile.gettempdir()) / "rolloutpool-cpu-bind"


def claim_cores(choices: str) -> tuple[str, int | None]:
    """The first of the ``;``-separated core sets in ``choices`` that no other process of this
    host holds, and the descriptor holding its lock (closed when the process dies, which frees
    it). If every set is held: the first one, shared, and None."""
    CORE_LOCKS.mkdir(parents=True, exist_ok=True)
    options = [c.strip() for c in choices.split(";") if c.strip()]
    for cores in options:
        fd = os.open(CORE_LOCKS / f"{cores}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return cores, fd
    return options[0], None


class ReplicaActor:
    """One replica's server on the node Ray placed this actor on (see the module docstring)."""

    def __init__(self, replica_id: str, spec: dict[str, Any], cpu_bind_env: str | None) -> None:
        self.replica_id = replica_id
        self.node_address: str = ray.util.get_node_ip_address()
        base = ReplicaSpec.model_validate(spec)
        choices = os.environ.get(cpu_bind_env) if cpu_bind_env else None
        self._cores_lock: int | None = None
        cpu_bind = base.cpu_bind
        if choices:
            cpu_bind, self._cores_lock = claim_cores(choices)
        self.spec = base.model_copy(update={"host": self.node_address, "cpu_bind": cpu_bind})
        self.launcher = LocalReplica(self.spec)
        self._leash: Leash | None = None

    def ready(self) -> bool:
        """Answers once the actor is placed and constructed."""
        return True

    async def start(self) -> dict[str, Any]:
        """Start the server; the identity once it serves, or ``{"error": why}`` (nothing left
        running then)."""
        task = asyncio.create_task(self.launcher.start())
        await asyncio.sleep(0)  # LocalReplica.start spawns before its first await
        if self.launcher.pid is not None:
            self._leash = await asyncio.to_thread(attach, self.launcher.pid)
        try:
            await task
        except LaunchError as e:
            self._unleash()
            return {"error": e.message}
        return self.identity()

    def identity(self) -> dict[str, Any]:
        """Where the server is and which process it is (read now)."""
        ctx = ray.get_runtime_context()
        pid = self.launcher.pid
        return {
            "url": self.launcher.url,
            "node_address": self.node_address,
            "node_id": ctx.get_node_id(),
            "actor_id": ctx.get_actor_id(),
            "pid": pid,
            "pid_start": start_ticks(pid) if pid is not None else None,
            "alive": self.launcher.alive,
            "cpu_bind": self.spec.cpu_bind,
            "log": str(self.launcher.log_path),
        }

    def alive(self) -> bool:
        """Whether the server process group's leader is still running."""
        return self.launcher.alive

    async def stop(self) -> None:
        """SIGTERM the server's group, then SIGKILL it (see :meth:`LocalReplica.stop`)."""
        await self.launcher.stop()
        self._unleash()
        if self._cores_lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._cores_lock)
            self._cores_lock = None

    def _unleash(self) -> None:
        if self._leash is not None:
            self._leash.cut()
            self._leash = None
