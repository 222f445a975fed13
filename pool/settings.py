"""Settings shared by router and updater (pydantic-settings; env prefix ``ROLLOUTPOOL_``).

Built once in each ``__main__`` and passed down; nothing else reads the environment.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_PLACEHOLDER = re.compile(r"change[-_ ]?me|replace[-_ ]?me|<[^>]*>", re.IGNORECASE)


def refuse_placeholder(secret: SecretStr | None, what: str) -> SecretStr | None:
    """``secret`` unless it is a template placeholder (``CHANGE-ME-...``, ``<token>``): a
    deployment that forgot to set a real secret must fail to start, not run with a published one.
    The error names the setting, never the value."""
    if secret is not None and _PLACEHOLDER.search(secret.get_secret_value()):
        raise ValueError(f"{what} is still a placeholder from the templates: set a real secret")
    return secret


class StoreSettings(BaseSettings):
    """How to reach Redis and how the pool's keys behave.

    Durability: the store relies on Redis persistence. Run Redis with ``appendonly yes`` and
    ``appendfsync everysec``: a Redis crash (not a restart) can lose up to ~1 s of writes, i.e.
    the last admissions/releases/transitions; a clean restart loses nothing.
    """

    model_config = SettingsConfigDict(env_prefix="ROLLOUTPOOL_REDIS_", extra="ignore")

    url: str = "redis://127.0.0.1:6379/0"
    username: str | None = None
    password: SecretStr | None = None
    namespace: str = Field(default="rp", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    socket_timeout_s: float = Field(default=2.0, gt=0)
    #: Connections this process may open to Redis; a call waits up to ``pool_timeout_s`` for a
    #: free one (then StoreBusy, never "Redis down"). Every call is one short script or
    #: pipeline, so a few dozen carry thousands of concurrent rollouts.
    max_connections: int = Field(default=64, ge=1)
    pool_timeout_s: float = Field(default=5.0, gt=0)
    binding_lease_s: float = Field(default=60.0, gt=0)
    #: Memory is bounded by design (README "Sizing Redis"): a finished rollout's full record is
    #: kept ``binding_retention_s`` (about 0.5 KB each), the journal keeps its newest
    #: ``journal_maxlen`` entries (two per rollout, about 0.13 KB each) and at most
    #: ``update_records_max`` update records are kept; per-generation counts are kept for good.
    binding_retention_s: float = Field(default=600.0, gt=0)
    journal_maxlen: int = Field(default=100_000, ge=1000)
    update_records_max: int = Field(default=1000, ge=10)
    updater_lease_s: float = Field(default=15.0, gt=0)

    @field_validator("password")
    @classmethod
    def _real_password(cls, v: SecretStr | None) -> SecretStr | None:
        return refuse_placeholder(v, "the Redis password")

    @property
    def safe_url(self) -> str:
        """:attr:`url` without credentials (userinfo and ``password``/``username`` query
        parameters are dropped): the only form that may appear in a log or an answer."""
        return redact_url(self.url)


_SECRET_PARAMS = frozenset({"password", "username", "user", "pass", "auth", "token"})


def redact_url(url: str) -> str:
    """``url`` with any userinfo and credential query parameters removed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    query = [(k, v) for k, v in parse_qsl(parts.query) if k.lower() not in _SECRET_PARAMS]
    return urlunsplit((parts.scheme, host, parts.path, urlencode(query), ""))
