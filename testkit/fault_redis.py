"""The fault rig's Redis and the faults it takes (:mod:`testkit.faults`,
:mod:`testkit.fault_cells`).

* :class:`StandaloneRedis` — one ``redis-server`` with AOF. Its faults hit that server: killed
  and restarted (the AOF replays), stopped past the lease and resumed, stopped cleanly and
  restarted, restarted at once.
* :class:`SentinelRedis` — a Sentinel group (a primary, two replicas, three sentinels; the
  pool's stores set ``wait_replicas`` 1, as the shipped Sentinel deployment does). Its faults
  hit the *current primary*, so the sentinels fail over: killed (a replica is promoted; the old
  node comes back as a replica), stopped past the sentinels' ``down-after`` and resumed (it
  returns to find itself demoted), stopped cleanly, restarted at once (it may come back before
  the sentinels agree it is down). :meth:`SentinelRedis.stall_replication` stops every replica
  instead: with ``wait_replicas`` 1 and ``min-replicas-to-write`` 1 the primary keeps answering
  reads, and every write is either refused or reported unreplicated until they resume.

Both are driven from the rig's event loop; the blocking parts (starting processes, asking the
sentinels) run in threads.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any, Literal

from pool.settings import StoreSettings
from testkit.redis_ha import SentinelGroup
from testkit.redis_server import RedisServer

__all__ = ["RedisKind", "RigRedis", "SentinelRedis", "StandaloneRedis"]

RedisKind = Literal["standalone", "sentinel"]


class StandaloneRedis:
    """One ``redis-server`` (AOF) in ``workdir``."""

    kind = "standalone"

    def __init__(self, workdir: Path) -> None:
        self.server = RedisServer(workdir / "redis")

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def settings(self, namespace: str) -> StoreSettings:
        return StoreSettings(url=self.server.url, namespace=namespace)

    @property
    def url(self) -> str:
        return self.server.url

    def router_env(self) -> dict[str, str]:
        return {}

    def updater_config(self) -> dict[str, Any]:
        return {"url": self.server.url}

    async def fault(self, fault: str, hold_s: float) -> None:
        """``fault`` on the server; returns once it answers again (SIGSTOP: after ``hold_s``)."""
        if fault == "SIGSTOP":
            self.server.signal(signal.SIGSTOP)
            await asyncio.sleep(hold_s)  # the fault itself: stopped past the lease
            self.server.signal(signal.SIGCONT)
            return
        if fault == "SIGKILL":
            self.server.signal(signal.SIGKILL)
        await asyncio.to_thread(self.server.stop)
        await asyncio.to_thread(self.server.start)


class SentinelRedis:
    """A :class:`~testkit.redis_ha.SentinelGroup` of one primary, two replicas and three
    sentinels; stores on it wait for one replica (``wait_replicas`` 1)."""

    kind = "sentinel"

    def __init__(self, workdir: Path) -> None:
        self.group = SentinelGroup(workdir / "sentinel", replicas=2, sentinels=3)

    def start(self) -> None:
        self.group.start()

    def stop(self) -> None:
        self.group.stop()

    def settings(self, namespace: str) -> StoreSettings:
        return self.group.store_settings(namespace)

    @property
    def url(self) -> str:
        return "redis://127.0.0.1:6379/0"  # only the database number counts with sentinels

    def router_env(self) -> dict[str, str]:
        return {
            "ROLLOUTPOOL_REDIS_SENTINELS": ",".join(self.group.sentinel_addresses),
            "ROLLOUTPOOL_REDIS_SENTINEL_SERVICE": self.group.service,
            "ROLLOUTPOOL_REDIS_WAIT_REPLICAS": "1",
        }

    def updater_config(self) -> dict[str, Any]:
        return {
            "sentinels": self.group.sentinel_addresses,
            "sentinel_service": self.group.service,
            "wait_replicas": 1,
        }

    async def fault(self, fault: str, hold_s: float) -> None:
        """``fault`` on the current primary; returns once the group has a primary with both
        replicas in sync again (the faulted node back as a replica where it was demoted)."""
        g = self.group
        old = await asyncio.to_thread(g.primary_port)
        node = g.node(old)
        if fault == "SIGSTOP":
            node.signal(signal.SIGSTOP)
            await asyncio.sleep(max(hold_s, 3 * g.down_after_ms / 1000))  # past down-after
            node.signal(signal.SIGCONT)  # the sentinels demote it once they see it again
        elif fault == "restart":
            await asyncio.to_thread(g.restart, old)  # at once: maybe back before a failover
        else:
            if fault == "SIGKILL":
                node.signal(signal.SIGKILL)
            await asyncio.to_thread(node.stop)
            await asyncio.to_thread(g.wait_promoted, old, 60.0)
            await asyncio.to_thread(g.restart, old)
        await asyncio.to_thread(g.wait_replicas_synced, None, len(g.nodes) - 1, 120.0)

    async def stall_replication(self, hold_s: float) -> None:
        """Stop every replica for ``hold_s`` (the primary stays up), then resume them and wait
        until they are in sync again."""
        g = self.group
        primary = await asyncio.to_thread(g.primary_port)
        replicas = [n for n in g.nodes if n.port != primary]
        for n in replicas:
            n.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(hold_s)
        finally:
            for n in replicas:
                n.signal(signal.SIGCONT)
        await asyncio.to_thread(g.wait_replicas_synced, primary, len(replicas), 120.0)


RigRedis = StandaloneRedis | SentinelRedis
