"""Routes both services serve alike: ``/healthz``, ``/metrics``, ``/v1/pool``, ``/openapi.json``.

They read the app's shared resources under the kit's keys: :data:`STORE` (the Redis store
client), :data:`REGISTRY` (the Prometheus registry) and :data:`POOL_GAUGES` (the pool gauges in
it). A service sets all three (the store in a cleanup context, while the app runs).

* ``GET /healthz`` — 200 ``{"status": "ok", ...}`` if Redis answers PING and the service's own
  readiness (if any) says so; else 503 ``{"status": "unavailable" | "starting", "error": {...}}``.
* ``GET /metrics`` — Prometheus text; the pool gauges and Redis's memory (used, maxmemory) are
  refreshed from the store on each scrape (skipped, not failed, while Redis is down:
  ``rolloutpool_redis_up`` says so).
* ``GET /v1/pool`` — :class:`PoolView`, read from the store: the published generation, the
  admissible staleness and every replica. Replica URLs (a dev-mode vLLM server's control
  routes are unauthenticated) are shown only to the admin token, ``null`` otherwise.
* ``GET /openapi.json`` — the service's document.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from pool.errors import StoreError
from pool.metrics import PoolGauges
from pool.store import RedisStore
from pool.types import ReplicaState
from pool.web.auth import CLIENT
from pool.web.responses import json_response

log = logging.getLogger("pool.web")

STORE = web.AppKey("store", RedisStore)
REGISTRY = web.AppKey("registry", CollectorRegistry)
POOL_GAUGES = web.AppKey("pool_gauges", PoolGauges)


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"),]+", re.IGNORECASE)
_PATH = re.compile(r"(?<![^\s(='\"\[])/[^\s'\"),]+")


def public_reason(reason: str) -> str:
    """A replica's reason as anyone may read it: URLs and absolute paths (a replica's address,
    a checkpoint's location) replaced by ``<url>`` and ``<path>``. The admin sees it whole."""
    return _PATH.sub("<path>", _URL.sub("<url>", reason))


class PublishedGeneration(BaseModel):
    generation: int
    label: str
    identity_digest: str


class ReplicaSummary(BaseModel):
    replica_id: str
    state: ReplicaState
    generation: int | None
    label: str | None
    identity_digest: str | None
    active: int
    capacity: int
    url: str | None = Field(description="the replica's URL; null unless the admin token is used")
    reason: str
    updated_ms: int


class PoolView(BaseModel):
    """``GET /v1/pool`` of both services."""

    latest: PublishedGeneration | None
    max_staleness: int
    replicas: list[ReplicaSummary]


async def read_pool_view(store: RedisStore, max_staleness: int, *, urls: bool) -> PoolView:
    """The pool as the store has it now (not a cached view); replica URLs, and reasons with
    the URLs and paths they name, only with ``urls`` (:func:`public_reason` otherwise).
    Raises ``StoreUnavailable``."""
    replicas = await store.replicas()
    latest = await store.latest()
    return PoolView(
        latest=None
        if latest is None
        else PublishedGeneration(
            generation=latest[0].number, label=latest[0].label, identity_digest=latest[1]
        ),
        max_staleness=max_staleness,
        replicas=[
            ReplicaSummary.model_validate(
                {
                    **r.model_dump(),
                    "url": r.url if urls else None,
                    "reason": r.reason if urls else public_reason(r.reason),
                }
            )
            for r in replicas
        ],
    )


def pool_handler(max_staleness: int) -> Handler:
    async def pool(request: web.Request) -> web.Response:
        admin = request.get(CLIENT) == "admin"
        view = await read_pool_view(request.app[STORE], max_staleness, urls=admin)
        return json_response(view.model_dump(mode="json"))

    return pool


#: A service's own readiness beyond Redis: ``(ready, extra body fields)``.
Readiness = Callable[[web.Application], tuple[bool, Mapping[str, Any]]]


def healthz_handler(readiness: Readiness | None = None) -> Handler:
    async def healthz(request: web.Request) -> web.Response:
        try:
            await request.app[STORE].ping()
        except StoreError as e:
            error = {"code": "store_unavailable", "message": e.message}
            return json_response({"status": "unavailable", "error": error}, status=503)
        ready, extra = (True, {}) if readiness is None else readiness(request.app)
        if not ready:
            error = {"code": "not_ready", "message": "the service is not ready to act"}
            return json_response({"status": "starting", **extra, "error": error}, status=503)
        return json_response({"status": "ok", **extra})

    return healthz


def metrics_handler() -> Handler:
    async def metrics(request: web.Request) -> web.Response:
        app = request.app
        gauges, store = app[POOL_GAUGES], app[STORE]
        try:
            replicas = await store.replicas()
            latest = await store.latest()
            gauges.observe(replicas, latest[0].number if latest else None)
            gauges.redis_up.set(1)
        except StoreError as e:
            gauges.redis_up.set(0)
            log.warning("metrics: pool gauges not refreshed: %s", e.message)
        else:
            try:  # a separate step: an ACL user may be refused INFO while Redis is fine
                gauges.observe_redis(*await store.memory())
            except StoreError as e:
                log.warning("metrics: Redis memory not refreshed: %s", e.message)
        return web.Response(
            body=generate_latest(app[REGISTRY]), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    return metrics


def openapi_handler(document: Callable[[], dict[str, Any]]) -> Handler:
    async def openapi(request: web.Request) -> web.Response:
        return json_response(document())

    return openapi
