"""Client authentication, the admin boundary and optional rate limiting (middleware factories).

Three classes of routes:

* **public** — ``GET /healthz``, ``GET /metrics`` and ``GET /dashboard`` (probes, scrapes and a
  read-only status page; none reveals a secret, a prompt or a replica URL).
* **admin** — every path under ``/v1/admin/``. Needs ``Authorization: Bearer <admin_token>``.
  No header → 401; any other token, client API keys included → 403; no admin token configured
  → 403 ``admin_disabled``. Checked before routing, so an unknown admin path is also refused.
* **client** — everything else. When ``api_keys`` is non-empty, ``Authorization: Bearer <key>``
  must match one of them (or the admin token) → else 401. With no keys configured, anyone may
  call the data plane.

Tokens are compared with :func:`hmac.compare_digest` against *every* configured secret (no
early exit), and never logged. The authenticated identity (``key:<n>``, ``admin`` or
``anonymous:<peer>``) is stored in ``request[CLIENT]`` for the rate limiter.
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.errors import Forbidden, Handler, RateLimited, Unauthorized
from router.settings import RouterSettings

PUBLIC_PATHS = frozenset({"/healthz", "/metrics", "/dashboard", "/openapi.json"})
ADMIN_PREFIX = "/v1/admin/"

CLIENT = web.RequestKey("client", str)


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _match(token: bytes, secrets: list[bytes]) -> int | None:
    """Index of the secret equal to ``token`` (constant time per secret, all compared)."""
    found: int | None = None
    for i, secret in enumerate(secrets):
        if hmac.compare_digest(token, secret) and found is None:
            found = i
    return found


def auth_middleware(settings: RouterSettings) -> Any:
    """Build the auth middleware from the configured secrets (read once, here)."""
    keys = [k.get_secret_value().encode() for k in settings.api_keys]
    admin = [settings.admin_token.get_secret_value().encode()] if settings.admin_token else []

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in PUBLIC_PATHS:
            return await handler(request)
        token = bearer_token(request)
        raw = token.encode() if token is not None else b""
        if path.startswith(ADMIN_PREFIX):
            if not admin:
                raise Forbidden(
                    "the admin API is disabled (set ROLLOUTPOOL_ROUTER_ADMIN_TOKEN)",
                    code="admin_disabled",
                )
            if token is None:
                raise Unauthorized("admin token required (Authorization: Bearer ...)")
            if _match(raw, admin) is None:
                raise Forbidden("this token may not use the admin API")
            request[CLIENT] = "admin"
            return await handler(request)
        if keys:
            if token is None:
                raise Unauthorized("API key required (Authorization: Bearer ...)")
            index = _match(raw, keys)
            if index is None:
                if _match(raw, admin) is None:
                    raise Unauthorized("invalid API key")
                request[CLIENT] = "admin"
            else:
                request[CLIENT] = f"key:{index}"
        else:
            request[CLIENT] = f"anonymous:{request.remote or '-'}"
        return await handler(request)

    return auth


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class TokenBuckets:
    """One token bucket per client identity: ``rate`` tokens/s, at most ``burst`` saved."""

    def __init__(self, rate: float, burst: int, max_clients: int = 10_000) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: dict[str, _Bucket] = {}

    def take(self, client: str, now: float | None = None) -> float:
        """Take one token; return 0.0 if granted, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        b = self._buckets.get(client)
        if b is None:
            if len(self._buckets) >= self.max_clients:
                self._buckets.clear()  # crude bound on memory; resets everyone's budget
            b = self._buckets[client] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.stamp) * self.rate)
        b.stamp = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / self.rate


def rate_limit_middleware(settings: RouterSettings) -> Any:
    """429 with ``Retry-After`` once a client exceeds ``rate_limit_per_s`` (burst allowed).

    Runs after :func:`auth_middleware`; public and admin routes are not limited.
    """
    rate = settings.rate_limit_per_s
    buckets = TokenBuckets(rate, settings.rate_limit_burst) if rate else None

    @web.middleware
    async def limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        client = request.get(CLIENT)
        if buckets is not None and client is not None and client != "admin":
            wait = buckets.take(client)
            if wait > 0:
                raise RateLimited(
                    f"rate limit of {rate}/s exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        return await handler(request)

    return limit
