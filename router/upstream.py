"""The upstream side: one pooled HTTP client session and what the router knows of each replica.

:func:`client_session` builds the one :class:`aiohttp.ClientSession` every forwarded request
uses (a connection pool of ``upstream_connections``; idle connections are dropped after
``upstream_keepalive_s``, below vLLM's own keep-alive, so a pooled connection is never reused
just as the server closes it; no cookie jar: what one replica sets is never sent on another
rollout's request).

:class:`ReplicaCatalog` answers "which model id does this replica serve and which vLLM version
is it" from ``GET /v1/models`` and ``GET /version``, fetched once per (replica, url, generation)
and cached; concurrent requests share one fetch. vLLM names its model by the path it was started
with, and a replica restarted for recovery may be started from a new path, hence the key.
A failed fetch is not cached: it raises :class:`~router.errors.UpstreamError` (502, a message
without the replica's URL: the details go to the log) and the next request tries again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from pool.engine import Capabilities
from pool.types import ReplicaRecord
from router.errors import UpstreamError
from router.settings import RouterSettings

INFO_TIMEOUT_S = 10.0

log = logging.getLogger("router")


def client_session(settings: RouterSettings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=settings.upstream_connections,
        limit_per_host=0,
        keepalive_timeout=settings.upstream_keepalive_s,
        enable_cleanup_closed=False,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=settings.upstream_connect_timeout_s,
        sock_read=settings.upstream_timeout_s,
    )
    headers: dict[str, str] = {}
    if settings.upstream_api_key is not None:
        headers["Authorization"] = f"Bearer {settings.upstream_api_key.get_secret_value()}"
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers=headers,
        cookie_jar=aiohttp.DummyCookieJar(),  # a replica's cookies are never replayed
        auto_decompress=False,
        raise_for_status=False,
    )


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica's vLLM server says about itself."""

    model_id: str
    capabilities: Capabilities


class ReplicaCatalog:
    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self._known: dict[tuple[str, str, int | None], asyncio.Future[ReplicaInfo]] = {}

    @staticmethod
    def _key(r: ReplicaRecord) -> tuple[str, str, int | None]:
        return r.replica_id, r.url, r.generation

    def cached(self, r: ReplicaRecord) -> ReplicaInfo | None:
        fut = self._known.get(self._key(r))
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    async def info(self, r: ReplicaRecord) -> ReplicaInfo:
        """The replica's model id and capabilities (cached; one fetch at a time per key)."""
        key = self._key(r)
        fut = self._known.get(key)
        if fut is None:
            for old in [k for k in self._known if k[0] == r.replica_id]:
                del self._known[old]
            fut = self._known[key] = asyncio.ensure_future(self._fetch(r))
            fut.add_done_callback(lambda f: self._forget_failure(key, f))
        return await asyncio.shield(fut)

    def _forget_failure(self, key: tuple[str, str, int | None], fut: asyncio.Future[Any]) -> None:
        if (fut.cancelled() or fut.exception() is not None) and self._known.get(key) is fut:
            del self._known[key]

    def forget(self, r: ReplicaRecord) -> None:
        """Drop the cached entry (e.g. after the replica said it does not know the model)."""
        self._known.pop(self._key(r), None)

    async def _get(self, r: ReplicaRecord, path: str) -> dict[str, Any]:
        url = r.url.rstrip("/") + path
        try:
            async with self.http.get(
                url, timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200 or not isinstance(body, dict):
                    raise UpstreamError(
                        f"replica {r.replica_id}: GET {path} answered HTTP {resp.status}",
                        code="upstream_unavailable",
                        replica=r.replica_id,
                    )
                return body
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("replica %s: GET %s failed: %r", r.replica_id, url, e)
            raise UpstreamError(
                f"replica {r.replica_id}: GET {path} failed ({type(e).__name__})",
                code="upstream_unavailable",
                replica=r.replica_id,
            ) from e

    async def _fetch(self, r: ReplicaRecord) -> ReplicaInfo:
        models, version = await asyncio.gather(self._get(r, "/v1/models"), self._get(r, "/version"))
        data = models.get("data")
        model_id = data[0].get("id") if isinstance(data, list) and data else None
        raw_version = version.get("version")
        if not isinstance(model_id, str) or not isinstance(raw_version, str):
            raise UpstreamError(
                f"replica {r.replica_id}: no model id / version in its answers",
                code="upstream_unavailable",
                replica=r.replica_id,
            )
        try:
            caps = Capabilities.from_version(raw_version)
        except ValueError as e:
            raise UpstreamError(
                f"replica {r.replica_id}: {e}", code="upstream_unavailable", replica=r.replica_id
            ) from e
        return ReplicaInfo(model_id=model_id, capabilities=caps)
