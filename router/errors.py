"""Router errors and the one middleware that turns every error into an HTTP JSON answer.

::

    RolloutPoolError (pool.errors)
    └── RouterError                    status 500   router_error
        ├── BadRequest                 400          invalid_json, invalid_body, invalid_header...
        ├── Unauthorized               401          unauthorized (WWW-Authenticate: Bearer)
        ├── Forbidden                  403          forbidden, admin_disabled
        ├── RouteNotFound              404          not_found, model_not_found, rollout_not_found
        ├── PayloadTooLarge            413          payload_too_large
        ├── Conflict                   409          generation_unsatisfiable, rollout_not_active...
        ├── RateLimited                429          rate_limited (Retry-After)
        ├── NoReplicaAvailable         503          no_replica_available (Retry-After)
        ├── BindingEnded               503          binding_ended: output withheld (Retry-After)
        ├── UpstreamError              502          upstream_error, upstream_unavailable,
        │                                           provenance_violation
        └── UpstreamTimeout            504          upstream_timeout

Every body has the shape ``{"error": {"code", "message", ...context}}``. Pool errors that reach
the middleware are mapped too: ``StoreUnavailable`` → 503 ``store_unavailable`` (admission
fails closed), ``NotFound`` → 404, ``StoreConflict`` → 409, other store errors → 503. aiohttp's
own HTTP exceptions (unknown route, wrong method, oversized body) become JSON with their status.
Anything else is a 500 ``internal_error`` whose details go to the log, not to the client.

The middleware never touches a response the handler returned (streamed responses included): a
streaming handler must handle its own errors once it has called ``prepare``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from pool.errors import (
    AdmissionRefused,
    NotFound,
    RolloutPoolError,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger("router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouterError(RolloutPoolError):
    """An error with an HTTP status. ``code`` may be overridden per instance."""

    status: int = 500
    code = "router_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})


class BadRequest(RouterError):
    status = 400
    code = "bad_request"


class Unauthorized(RouterError):
    status = 401
    code = "unauthorized"

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"}, **context)


class Forbidden(RouterError):
    status = 403
    code = "forbidden"


class RouteNotFound(RouterError):
    status = 404
    code = "not_found"


class PayloadTooLarge(RouterError):
    status = 413
    code = "payload_too_large"


class Conflict(RouterError):
    status = 409
    code = "conflict"


class RateLimited(RouterError):
    status = 429
    code = "rate_limited"


class NoReplicaAvailable(RouterError):
    """No replica admitted the rollout within the admission wait; retryable."""

    status = 503
    code = "no_replica_available"


class BindingEnded(RouterError):
    """The rollout's binding was ended while its request ran; the output is withheld."""

    status = 503
    code = "binding_ended"


class UpstreamError(RouterError):
    status = 502
    code = "upstream_error"


class UpstreamTimeout(RouterError):
    status = 504
    code = "upstream_timeout"


def dumps(obj: Any) -> str:
    """Compact JSON (the router's one serializer)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        text=dumps(body),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(
    err: RolloutPoolError, status: int, headers: Mapping[str, str] | None = None
) -> web.Response:
    return json_response(err.to_dict(), status=status, headers=headers)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _from_http_exception(e: web.HTTPException) -> web.Response:
    code = _HTTP_CODES.get(e.status, "http_error")
    headers: dict[str, str] = {}
    context: dict[str, Any] = {}
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = sorted(e.allowed_methods)
        headers["Allow"] = ",".join(allowed)
        message = f"method {e.method} is not allowed here; allowed: {', '.join(allowed)}"
        context["allowed"] = allowed
    elif e.status == 404:
        message = "no such route (the router serves only its documented API)"
    elif e.status == 413:
        message = e.text or "request body too large"
    else:
        message = e.reason
    body = {"error": {"code": code, "message": message, **context}}
    return json_response(body, status=e.status, headers=headers)


def _status_of(e: RolloutPoolError) -> int:
    if isinstance(e, RouterError):
        return e.status
    if isinstance(e, StoreUnavailable | AdmissionRefused):
        return 503
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, StoreConflict):
        return 409
    if isinstance(e, StoreError):
        return 503
    return 500


def error_middleware(retry_after_s: int) -> Any:
    """The outermost middleware: map every exception to a JSON error response."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RolloutPoolError as e:
            status = _status_of(e)
            headers = dict(e.headers) if isinstance(e, RouterError) else {}
            if status == 503 and "Retry-After" not in headers:
                headers["Retry-After"] = str(retry_after_s)
            if status >= 500:
                log.warning(
                    "%s %s -> %d %s: %s", request.method, request.path, status, e.code, e.message
                )
            return error_response(e, status, headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _from_http_exception(e)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            body = {"error": {"code": "internal_error", "message": "internal router error"}}
            return json_response(body, status=500)

    return errors
