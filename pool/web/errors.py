"""HTTP errors of both services, the one status table and the one error middleware.

::

    RolloutPoolError (pool.errors)
    └── HttpError                      status 500   http_error (status, code, headers per class)
        ├── BadRequest                 400          bad_request, invalid_json, invalid_body...
        ├── Unauthorized               401          unauthorized (WWW-Authenticate: Bearer)
        ├── Forbidden                  403          forbidden, admin_disabled
        ├── RouteNotFound              404          not_found, model_not_found, rollout_not_found
        ├── Conflict                   409          generation_unsatisfiable, rollout_not_active...
        ├── PayloadTooLarge            413          payload_too_large
        ├── Unprocessable              422          invalid_body (the updater's pydantic bodies)
        └── RateLimited                429          rate_limited (Retry-After)

Services subclass :class:`HttpError` for their own answers (the router's 502/503/504). Pool
errors get their status from :func:`status_of`, the one table both services use:

============================================  ======
``HttpError``                                  its ``status``
``StoreUnavailable``, ``AdmissionRefused``     503 (admission fails closed; ``Retry-After``)
``NotFound``                                   404
``StoreConflict``, ``LifecycleError``          409
``PreflightFailed``                            422
other ``StoreError`` (a Redis error reply)     503
any other ``RolloutPoolError``                 500
============================================  ======

Every error body is ``{"error": {"code", "message", ...context}}``. aiohttp's own HTTP exceptions
(unknown route, wrong method, oversized body) become the same JSON with their status; a 405
carries ``Allow`` (RFC 9110). Every 503 carries ``Retry-After``. Anything else is a 500
``internal_error`` whose details go to the log, never to the client.

The middleware never touches a response the handler returned (streamed responses included): a
streaming handler must handle its own errors once it has called ``prepare``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pool.errors import (
    AdmissionRefused,
    LifecycleError,
    NotFound,
    PreflightFailed,
    RolloutPoolError,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)
from pool.web.responses import json_response


class HttpError(RolloutPoolError, code="http_error"):
    """An error with an HTTP status. A subclass names its ``status`` and ``code`` in its bases
    (``class Conflict(HttpError, status=409, code="conflict")``); ``code`` may be overridden per
    instance; ``headers`` are sent with the answer (``WWW-Authenticate``, ``Retry-After``,
    ``X-Rollout-*``)."""

    status: int = 500

    def __init_subclass__(cls, *, status: int | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if status is not None:
            cls.status = status

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


class BadRequest(HttpError, status=400, code="bad_request"): ...


class Unauthorized(HttpError, status=401, code="unauthorized"):
    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"}, **context)


class Forbidden(HttpError, status=403, code="forbidden"): ...


class RouteNotFound(HttpError, status=404, code="not_found"): ...


class Conflict(HttpError, status=409, code="conflict"): ...


class PayloadTooLarge(HttpError, status=413, code="payload_too_large"): ...


class Unprocessable(HttpError, status=422, code="unprocessable"): ...


class RateLimited(HttpError, status=429, code="rate_limited"): ...


def status_of(e: RolloutPoolError) -> int:
    """The HTTP status of a pool error (the table in the module docstring)."""
    if isinstance(e, HttpError):
        return e.status
    if isinstance(e, StoreUnavailable | AdmissionRefused):
        return 503
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, StoreConflict | LifecycleError):
        return 409
    if isinstance(e, PreflightFailed):
        return 422
    if isinstance(e, StoreError):
        return 503
    return 500


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
        headers["Allow"] = ", ".join(allowed)
        message = f"method {e.method} is not allowed here; allowed: {', '.join(allowed)}"
        context["allowed"] = allowed
    elif e.status == 404:
        message = "no such route (only the documented API is served)"
    elif e.status == 413:
        message = e.text or "request body too large"
    else:
        message = e.reason
    body = {"error": {"code": code, "message": message, **context}}
    return json_response(body, status=e.status, headers=headers)


def error_middleware(log: logging.Logger, retry_after_s: int = 1) -> Middleware:
    """The outermost middleware: map every exception to a JSON error answer.

    ``retry_after_s`` is the ``Retry-After`` of a 503 that does not set its own. 5xx answers
    are logged (``log.warning``; an unexpected exception with its traceback).
    """

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RolloutPoolError as e:
            status = status_of(e)
            headers = dict(e.headers) if isinstance(e, HttpError) else {}
            if status == 503 and "Retry-After" not in headers:
                headers["Retry-After"] = str(retry_after_s)
            if status >= 500:
                log.warning(
                    "%s %s -> %d %s: %s", request.method, request.path, status, e.code, e.message
                )
            return json_response(e.to_dict(), status=status, headers=headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _from_http_exception(e)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            body = {"error": {"code": "internal_error", "message": "internal error (see the log)"}}
            return json_response(body, status=500)

    return errors
