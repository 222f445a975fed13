"""Building the redis-py client of a :class:`~pool.store.RedisStore` for each way of reaching
Redis (:attr:`pool.settings.StoreSettings.mode`).

* standalone: a bounded, blocking connection pool on ``url``;
* Sentinel: redis-py's :class:`~redis.asyncio.sentinel.Sentinel` with a *blocking*
  :class:`~redis.asyncio.sentinel.SentinelConnectionPool` of ``max_connections``: every new
  connection asks the sentinels for the current primary, and a connection that meets a
  demoted primary (``READONLY``) is dropped, so the client follows a failover by itself;
* Cluster: :class:`~redis.asyncio.cluster.RedisCluster` (one pool per node; all the pool's
  keys hash to one slot).

No I/O happens here; the first call connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from pool.settings import StoreSettings


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """A Sentinel-managed pool that *waits* for a free connection (up to ``timeout``) instead of
    failing, like the standalone store's pool (``StoreSettings.pool_timeout_s``)."""


@dataclass
class Clients:
    """The data client and, in Sentinel mode, the sentinels' client (for the failover epoch)."""

    data: Any  # aioredis.Redis | RedisCluster
    sentinel: Sentinel | None = None

    async def aclose(self) -> None:
        if isinstance(self.data, RedisCluster):
            await self.data.aclose()
        else:
            await self.data.aclose(close_connection_pool=True)
        if self.sentinel is not None:
            await self.sentinel.aclose()


def _common(s: StoreSettings) -> dict[str, Any]:
    return {
        "username": s.username,
        "password": s.password.get_secret_value() if s.password else None,
        "decode_responses": True,
        "socket_timeout": s.socket_timeout_s,
        "socket_connect_timeout": s.socket_timeout_s,
        "retry_on_timeout": False,
    }


def _db(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def connect(s: StoreSettings) -> Clients:
    """The clients for ``s`` (see the module docstring)."""
    if s.mode == "cluster":
        kw = _common(s)
        del kw["retry_on_timeout"]  # not a RedisCluster option
        cluster = RedisCluster.from_url(s.url, max_connections=s.max_connections, **kw)
        return Clients(cluster)
    if s.mode == "sentinel":
        sentinel = Sentinel(
            s.sentinel_addresses(),
            sentinel_kwargs={
                "username": s.sentinel_username,
                "password": (
                    s.sentinel_password.get_secret_value() if s.sentinel_password else None
                ),
                "decode_responses": True,
                "socket_timeout": s.socket_timeout_s,
                "socket_connect_timeout": s.socket_timeout_s,
            },
        )
        data = sentinel.master_for(
            s.sentinel_service,
            connection_pool_class=BlockingSentinelPool,
            max_connections=s.max_connections,
            timeout=s.pool_timeout_s,
            db=_db(s.url),
            health_check_interval=10,
            **_common(s),
        )
        return Clients(data, sentinel)
    pool = aioredis.BlockingConnectionPool.from_url(
        s.url,
        max_connections=s.max_connections,
        timeout=s.pool_timeout_s,
        health_check_interval=10,
        **_common(s),
    )
    return Clients(aioredis.Redis(connection_pool=pool))
