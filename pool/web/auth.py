"""Bearer authentication and the admin boundary: one rule set for both services.

An :class:`AuthPolicy` sorts every path into one of three classes:

* **public** — served to anyone (probes, scrapes, the OpenAPI document, ...).
* **admin** — paths under one of ``admin_prefixes``. Needs ``Authorization: Bearer
  <admin_token>``. No bearer header → 401 ``unauthorized`` with ``WWW-Authenticate: Bearer``;
  no admin token configured → 403 ``admin_disabled``; any other token, client keys included →
  403 ``forbidden``. Checked before routing, so an unknown admin path is refused too.
* **client** — everything else. With client keys configured, the bearer token must be one of
  them or the admin token, else 401 ``unauthorized``. With none configured, anyone may call.

Tokens are compared with :func:`hmac.compare_digest` against *every* configured secret (no
early exit), and never logged. The authenticated identity (``key:<n>``, ``admin`` or
``anonymous:<peer>``) is stored in ``request[CLIENT]`` (a rate limiter keys on it).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import SecretStr

from pool.web.errors import Forbidden, Unauthorized

CLIENT = web.RequestKey("client", str)


@dataclass(frozen=True)
class AuthPolicy:
    """Which paths are public and which are admin; the secrets (read once, by the factory)."""

    public: frozenset[str]
    admin_prefixes: tuple[str, ...]
    admin_token: SecretStr | None = None
    api_keys: Sequence[SecretStr] = ()

    def is_admin(self, path: str) -> bool:
        return path.startswith(self.admin_prefixes)


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _match(token: bytes, secrets: Sequence[bytes]) -> int | None:
    """Index of the secret equal to ``token`` (constant time per secret, all compared)."""
    found: int | None = None
    for i, secret in enumerate(secrets):
        if hmac.compare_digest(token, secret) and found is None:
            found = i
    return found


def auth_middleware(policy: AuthPolicy) -> Middleware:
    """The middleware enforcing ``policy`` (see the module docstring)."""
    keys = [k.get_secret_value().encode() for k in policy.api_keys]
    admin = [policy.admin_token.get_secret_value().encode()] if policy.admin_token else []

    def identify(request: web.Request) -> str:
        """The caller of a non-public path; raises 401/403 per the rules."""
        token = bearer_token(request)
        raw = token.encode() if token is not None else b""
        if policy.is_admin(request.path):
            if token is None:
                raise Unauthorized("admin token required (Authorization: Bearer ...)")
            if not admin:
                raise Forbidden(
                    "the admin API is disabled (no admin token is configured)",
                    code="admin_disabled",
                )
            if _match(raw, admin) is None:
                raise Forbidden("this token may not use the admin API")
            return "admin"
        if not keys:
            return f"anonymous:{request.remote or '-'}"
        if token is None:
            raise Unauthorized("API key required (Authorization: Bearer ...)")
        index = _match(raw, keys + admin)
        if index is None:
            raise Unauthorized("invalid API key")
        return f"key:{index}" if index < len(keys) else "admin"

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in policy.public:
            request[CLIENT] = identify(request)
        return await handler(request)

    return auth
