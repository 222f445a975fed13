"""The router's auth policy (on the kit's rule set) and optional rate limiting.

Three classes of routes (the rules are :mod:`pool.web.auth`'s, shared with the updater):

* **public** — ``GET /healthz``, ``GET /metrics``, ``GET /dashboard`` (and the JSON it polls,
  ``GET /dashboard/data``) and ``GET /openapi.json`` (probes, scrapes, a read-only status page
  and the API document; none reveals a secret, a prompt or a replica URL).
* **admin** — every path under ``/v1/admin/``: ``Authorization: Bearer <admin_token>``.
* **client** — everything else. When ``api_keys`` is non-empty, ``Authorization: Bearer <key>``
  must match one of them (or the admin token). With no keys configured, anyone may call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pool.web import CLIENT, AuthPolicy, RateLimited, auth_middleware
from router.settings import RouterSettings

PUBLIC_PATHS = frozenset({"/healthz", "/metrics", "/dashboard", "/dashboard/data", "/openapi.json"})
ADMIN_PREFIX = "/v1/admin/"


def router_auth(settings: RouterSettings) -> Middleware:
    """The kit's auth middleware with the router's paths and secrets."""
    return auth_middleware(
        AuthPolicy(
            public=PUBLIC_PATHS,
            admin_prefixes=(ADMIN_PREFIX,),
            admin_token=settings.admin_token,
            api_keys=settings.api_keys,
        )
    )


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


def rate_limit_middleware(settings: RouterSettings) -> Middleware:
    """429 with ``Retry-After`` once a client exceeds ``rate_limit_per_s`` (burst allowed).

    Runs after :func:`router_auth`; public and admin routes are not limited.
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
