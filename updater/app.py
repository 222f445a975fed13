"""The updater's HTTP API (aiohttp): the trainer pushes checkpoints here.

Routes (all JSON; errors are ``{"error": {"code", "message", ...}}``):

* ``POST /v1/updates`` (admin) — :class:`~updater.service.UpdateRequest` → 202 with the update
  record (id, generation, label, state ``queued``). A checkpoint that fails the read-only
  preflight (missing path, wrong names/shapes/dtypes) → 422 ``preflight_failed``, nothing queued.
* ``GET /v1/updates/{id}`` (admin) — the record with each replica's outcome, phases and timings.
* ``GET /v1/updates`` (admin) — the newest records, newest first (``?limit=``, max 1000).
* ``GET /v1/pool`` — replicas, states, generations; ``GET /healthz``; ``GET /metrics``;
  ``GET /openapi.json`` (:mod:`updater.openapi`).

Admin routes need ``Authorization: Bearer <admin_token>`` (401 without, 403 with another
token; tokens compared in constant time). With no admin token configured they answer 403.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from pool.errors import NotFound, PreflightFailed, RolloutPoolError, StoreUnavailable
from pool.metrics import UpdaterMetrics
from updater.api import UpdateRequest
from updater.openapi import document
from updater.service import Updater
from updater.settings import UpdaterSettings

log = logging.getLogger("updater")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
UPDATER = web.AppKey("updater", Updater)
REGISTRY = web.AppKey("registry", CollectorRegistry)
METRICS = web.AppKey("metrics", UpdaterMetrics)
PUBLIC = frozenset({"/healthz", "/metrics", "/v1/pool", "/openapi.json"})
MAX_BODY = 1 << 20


def _error(status: int, code: str, message: str, **ctx: Any) -> web.Response:
    body = {"error": {"code": code, "message": message, **ctx}}
    return web.json_response(body, status=status)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            e.status, "http_error"
        )
        return _error(e.status, code, e.reason)
    except ValidationError as e:
        details = [{"loc": list(x["loc"]), "msg": x["msg"]} for x in e.errors()]
        return _error(422, "invalid_body", "request body failed validation", details=details)
    except PreflightFailed as e:
        return _error(
            422,
            "preflight_failed",
            e.message,
            **{k: v for k, v in e.context.items() if k != "diff"},
        )
    except NotFound as e:
        return _error(404, "not_found", e.message)
    except StoreUnavailable as e:
        return _error(503, "store_unavailable", e.message)
    except RolloutPoolError as e:
        return _error(409, e.code, e.message)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, "internal_error", "internal error (see the updater log)")


def admin_auth(settings: UpdaterSettings) -> Any:
    secret = settings.admin_token.get_secret_value().encode() if settings.admin_token else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return _error(401, "unauthorized", "admin token required (Authorization: Bearer)")
        if secret is None:
            return _error(403, "admin_disabled", "no admin token is configured")
        if not hmac.compare_digest(token.strip().encode(), secret):
            return _error(403, "forbidden", "this token may not use the updater API")
        return await handler(request)

    return auth


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise web.HTTPBadRequest(reason=f"invalid JSON: {e}") from e


async def post_update(request: web.Request) -> web.Response:
    body = await _json(request)
    if not isinstance(body, dict):
        return _error(400, "invalid_body", "the body must be a JSON object")
    req = UpdateRequest.model_validate(body)
    rec = await request.app[UPDATER].submit(req)
    return web.json_response(
        rec.model_dump(mode="json"), status=202, headers={"Location": f"/v1/updates/{rec.id}"}
    )


async def get_update(request: web.Request) -> web.Response:
    rec = await request.app[UPDATER].get(request.match_info["id"])
    return web.json_response(rec.model_dump(mode="json"))


async def list_updates(request: web.Request) -> web.Response:
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        return _error(400, "invalid_query", "limit must be an integer")
    limit = max(1, min(limit, 1000))
    recs = await request.app[UPDATER].list(limit)
    return web.json_response({"updates": [r.model_dump(mode="json") for r in recs]})


async def pool_view(request: web.Request) -> web.Response:
    return web.json_response(await request.app[UPDATER].pool_view())


async def healthz(request: web.Request) -> web.Response:
    up = request.app[UPDATER]
    try:
        await up.store.ping()
    except StoreUnavailable as e:
        return _error(503, "store_unavailable", e.message)
    ok = up.ready.is_set() and not up.lost.is_set()
    body = {"status": "ok" if ok else "starting", "lease": not up.lost.is_set()}
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    up, m = request.app[UPDATER], request.app[METRICS]
    try:
        latest = await up.store.latest()
        m.pool.observe(await up.store.replicas(), None if latest is None else latest[0].number)
    except StoreUnavailable:
        pass
    return web.Response(
        body=generate_latest(request.app[REGISTRY]), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())


def create_app(
    updater: Updater, settings: UpdaterSettings, registry: CollectorRegistry | None = None
) -> web.Application:
    """The API around a constructed :class:`Updater`. The caller starts/stops the updater
    (``cleanup_ctx`` does it when ``start_updater`` is used)."""
    app = web.Application(middlewares=[errors, admin_auth(settings)], client_max_size=MAX_BODY)
    reg = registry or CollectorRegistry()
    app[UPDATER] = updater
    app[REGISTRY] = reg
    app[METRICS] = updater.metrics or UpdaterMetrics.create(reg)
    app.router.add_post("/v1/updates", post_update)
    app.router.add_get("/v1/updates", list_updates)
    app.router.add_get("/v1/updates/{id}", get_update)
    app.router.add_get("/v1/pool", pool_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


def start_updater(app: web.Application) -> None:
    """Run the updater's start/stop with the app (``start`` blocks on the lease)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await app[UPDATER].start()
        yield
        await app[UPDATER].stop()

    app.cleanup_ctx.append(ctx)
