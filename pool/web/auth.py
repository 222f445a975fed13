"""Bearer authentication and the admin boundary: one rule set for both services.

An :class:`AuthPolicy` sorts every path into one of three classes:

* **public** — served to anyone (probes, scrapes, the OpenAPI document, ...). A public path
  called with the admin token is identified as ``admin`` (any other token is ignored), so a
  public route may show the admin more (``/v1/pool`` shows replica URLs only to the admin).
* **admin** — paths under one of ``admin_prefixes``. Needs ``Authorization: Bearer
  <admin_token>``. No bearer header → 401 ``unauthorized`` with ``WWW-Authenticate: Bearer``;
  no admin token configured → 403 ``admin_disabled``; any other token, client keys included →
  403 ``forbidden``. Checked before routing, so an unknown admin path is refused too.
* **client** — everything else. With client keys configured, the bearer token must be one of
  them or the admin token, else 401 ``unauthorized``. With none configured, anyone may call
  (the admin token still identifies the admin).

Tokens are compared with :func:`hmac.compare_digest` against *every* configured secret (no
early exit), and never logged. The authenticated identity is stored in ``request[CLIENT]``:
``key:<fingerprint>`` (the first 16 hex digits of the key's SHA-256: stable across routers,
key order and rotation, and not the key), ``admin`` or ``anonymous:<peer>``. The rate limit,
the client quotas and the owner of a rollout session key on it.
"""

from __future__ import annotations

import hashlib
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
    names = [f"key:{hashlib.sha256(k).hexdigest()[:16]}" for k in keys]

    def is_admin(request: web.Request) -> bool:
        token = bearer_token(request)
        return bool(admin) and token is not None and _match(token.encode(), admin) is not None

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
            return "admin" if is_admin(request) else f"anonymous:{request.remote or '-'}"
        if token is None:
            raise Unauthorized("API key required (Authorization: Bearer ...)")
        index = _match(raw, keys + admin)
        if index is None:
            raise Unauthorized("invalid API key")
        return names[index] if index < len(keys) else "admin"

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in policy.public:
            request[CLIENT] = identify(request)
        elif is_admin(request):
            request[CLIENT] = "admin"
        return await handler(request)

    return auth
