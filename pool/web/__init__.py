"""The HTTP kit both services are built on (aiohttp): one way to answer errors, authenticate,
write JSON, document the API, serve the shared routes and start a server.

Modules (read in this order):

* :mod:`pool.web.errors` — ``HttpError`` and its subclasses, the status table of pool errors
  (``status_of``), the one error middleware
* :mod:`pool.web.auth` — ``AuthPolicy`` (public / admin / client paths) and its middleware
* :mod:`pool.web.responses`, :mod:`pool.web.bodies` — JSON answers, reading a JSON body and
  validating it strictly
* :mod:`pool.web.handlers` — ``/healthz``, ``/metrics``, ``/v1/pool`` (``PoolView``),
  ``/openapi.json``, and the app keys they read (``STORE``, ``REGISTRY``, ``POOL_GAUGES``)
* :mod:`pool.web.openapi` — the Error schema, ``$ref``, response builders, the shared paths
* :mod:`pool.web.server` — ``start_server`` and ``run`` (handler cancellation on)
"""

from pool.web.auth import CLIENT, AuthPolicy, auth_middleware, bearer_token
from pool.web.bodies import read_json_object, validate_strictly
from pool.web.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    HttpError,
    PayloadTooLarge,
    RateLimited,
    RouteNotFound,
    Unauthorized,
    Unprocessable,
    error_middleware,
    status_of,
)
from pool.web.handlers import (
    POOL_GAUGES,
    REGISTRY,
    STORE,
    PoolView,
    healthz_handler,
    metrics_handler,
    openapi_handler,
    pool_handler,
    public_reason,
    read_pool_view,
)
from pool.web.responses import dumpb, dumps, json_response, loads
from pool.web.server import run, start_server

__all__ = [
    "CLIENT",
    "POOL_GAUGES",
    "REGISTRY",
    "STORE",
    "AuthPolicy",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "HttpError",
    "PayloadTooLarge",
    "PoolView",
    "RateLimited",
    "RouteNotFound",
    "Unauthorized",
    "Unprocessable",
    "auth_middleware",
    "bearer_token",
    "dumpb",
    "dumps",
    "error_middleware",
    "healthz_handler",
    "json_response",
    "loads",
    "metrics_handler",
    "openapi_handler",
    "pool_handler",
    "public_reason",
    "read_json_object",
    "read_pool_view",
    "run",
    "start_server",
    "status_of",
    "validate_strictly",
]
