"""The updater's HTTP API (aiohttp, on the HTTP kit :mod:`pool.web`): the trainer pushes
checkpoints here.

Routes (all JSON; errors are ``{"error": {"code", "message", ...}}``):

* ``POST /v1/updates`` (admin) — :class:`~updater.api.UpdateRequest` → 202 with the update
  record (id, generation, label, state ``queued``). A body that fails validation (strictly
  typed: ``"step": "5"`` or ``true`` is refused, not converted) → 422 ``invalid_body``; a
  checkpoint that fails the read-only preflight (missing path, wrong names/shapes/dtypes) →
  422 ``preflight_failed``, nothing queued.
* ``GET /v1/updates/{id}`` (admin) — the record with each replica's outcome, phases and timings.
* ``GET /v1/updates`` (admin) — the newest records, newest first (``?limit=`` in [1, 1000],
  default 100; outside → 400 ``invalid_query``).
* ``GET /v1/pool`` (the same view as the router's: :class:`pool.web.PoolView`),
  ``GET /healthz``, ``GET /metrics``, ``GET /openapi.json`` (:mod:`updater.openapi`).

Every other path is admin (the kit's rules, shared with the router): no bearer header → 401,
no admin token configured → 403 ``admin_disabled``, another token → 403.

Two ways to build it:

* :func:`create_app` ``(settings, store_settings)`` — the service (``python -m updater``). No
  I/O until it starts; one cleanup context then connects the store client, constructs the
  :class:`Updater` and starts it (blocking while another updater holds the lease), and on
  teardown stops it (replicas it launched included, lease released) and closes the store
  client. If starting fails, what was started is stopped and the client closed before the
  error propagates.
* :func:`create_api` ``(updater, settings)`` — only the API, around an updater the caller owns
  (constructs, starts, stops, and whose store client it closes): tests and scenarios that
  drive the updater directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from pool.metrics import UpdaterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.web import (
    POOL_GAUGES,
    REGISTRY,
    STORE,
    AuthPolicy,
    BadRequest,
    Unprocessable,
    auth_middleware,
    error_middleware,
    healthz_handler,
    json_response,
    metrics_handler,
    openapi_handler,
    pool_handler,
    read_json_object,
    validate_strictly,
)
from updater.api import UpdateRequest
from updater.openapi import MAX_LIST, document
from updater.service import Updater
from updater.settings import UpdaterSettings

log = logging.getLogger("updater")
UPDATER = web.AppKey("updater", Updater)
PUBLIC = frozenset({"/healthz", "/metrics", "/v1/pool", "/openapi.json"})
MAX_BODY = 1 << 20


async def post_update(request: web.Request) -> web.Response:
    body = await read_json_object(request, MAX_BODY)
    try:
        req = validate_strictly(UpdateRequest, body)  # a JSON true is not step 1
    except ValidationError as e:
        details = [{"loc": list(x["loc"]), "msg": x["msg"]} for x in e.errors()]
        raise Unprocessable(
            "request body failed validation", code="invalid_body", details=details
        ) from e
    # a client that disconnects must not cut a submission in half (handler cancellation is on)
    rec = await asyncio.shield(request.app[UPDATER].submit(req))
    return json_response(
        rec.model_dump(mode="json"), status=202, headers={"Location": f"/v1/updates/{rec.id}"}
    )


async def get_update(request: web.Request) -> web.Response:
    rec = await request.app[UPDATER].get(request.match_info["id"])
    return json_response(rec.model_dump(mode="json"))


async def list_updates(request: web.Request) -> web.Response:
    raw = request.query.get("limit", "100")
    try:
        limit = int(raw)
    except ValueError as e:
        raise BadRequest("limit must be an integer", code="invalid_query", limit=raw) from e
    if not 1 <= limit <= MAX_LIST:
        raise BadRequest(f"limit must be in [1, {MAX_LIST}]", code="invalid_query", limit=raw)
    recs = await request.app[UPDATER].list(limit)
    return json_response({"updates": [r.model_dump(mode="json") for r in recs]})


def _readiness(app: web.Application) -> tuple[bool, Mapping[str, Any]]:
    up = app[UPDATER]
    return up.ready.is_set() and not up.lost.is_set(), {"lease": not up.lost.is_set()}


def _api(
    settings: UpdaterSettings, metrics: UpdaterMetrics, registry: CollectorRegistry
) -> web.Application:
    """Routes and middlewares; ``UPDATER`` and ``STORE`` are set by the caller."""
    policy = AuthPolicy(public=PUBLIC, admin_prefixes=("/",), admin_token=settings.admin_token)
    app = web.Application(
        middlewares=[error_middleware(log), auth_middleware(policy)], client_max_size=MAX_BODY
    )
    app[REGISTRY] = registry
    app[POOL_GAUGES] = metrics.pool
    app.router.add_post("/v1/updates", post_update)
    app.router.add_get("/v1/updates", list_updates, allow_head=False)
    app.router.add_get("/v1/updates/{id}", get_update, allow_head=False)
    app.router.add_get("/v1/pool", pool_handler(settings.max_staleness), allow_head=False)
    app.router.add_get("/healthz", healthz_handler(_readiness), allow_head=False)
    app.router.add_get("/metrics", metrics_handler(), allow_head=False)
    app.router.add_get("/openapi.json", openapi_handler(document), allow_head=False)
    return app


def _updater_ctx(
    settings: UpdaterSettings, store_settings: StoreSettings, metrics: UpdaterMetrics
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def updater_ctx(app: web.Application) -> AsyncIterator[None]:
        store = RedisStore.connect(store_settings)
        try:
            updater = Updater(settings, store, metrics=metrics)
            app[UPDATER], app[STORE] = updater, store
            try:
                await updater.start()
                yield
            finally:
                await updater.stop()
        finally:
            await store.close()

    return updater_ctx


def create_app(
    settings: UpdaterSettings,
    store_settings: StoreSettings,
    registry: CollectorRegistry | None = None,
) -> web.Application:
    """The updater service: the API plus the updater and its store client as a cleanup context
    (see the module docstring). ``app[UPDATER]`` exists once the app has started."""
    registry = registry or CollectorRegistry()
    metrics = UpdaterMetrics.create(registry)
    app = _api(settings, metrics, registry)
    app.cleanup_ctx.append(_updater_ctx(settings, store_settings, metrics))
    return app


def create_api(
    updater: Updater, settings: UpdaterSettings, registry: CollectorRegistry | None = None
) -> web.Application:
    """The API around an updater the caller starts, stops and closes the store of."""
    registry = registry or CollectorRegistry()
    app = _api(settings, updater.metrics or UpdaterMetrics.create(registry), registry)
    app[UPDATER], app[STORE] = updater, updater.store
    return app
