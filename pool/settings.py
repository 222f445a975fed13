"""Settings shared by router and updater (pydantic-settings; env prefix ``ROLLOUTPOOL_``).

Built once in each ``__main__`` and passed down; nothing else reads the environment.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BeforeValidator, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_PLACEHOLDER = re.compile(r"change[-_ ]?me|replace[-_ ]?me|<[^>]*>", re.IGNORECASE)


def split_list(v: Any) -> Any:
    """A list setting given as one string: ``a,b,c`` (blanks dropped) or a JSON array; anything
    else is passed on to the field's own validation."""
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            return json.loads(text)
        return [x.strip() for x in text.split(",") if x.strip()]
    return v


T = TypeVar("T")

#: A list setting that may also be given as one string (:func:`split_list`), as an environment
#: variable is: pydantic-settings passes it on undecoded (``NoDecode``).
ListSetting = Annotated[list[T], NoDecode, BeforeValidator(split_list)]


def refuse_placeholder(secret: SecretStr | None, what: str) -> SecretStr | None:
    """``secret`` unless it is a template placeholder (``CHANGE-ME-...``, ``<token>``): a
    deployment that forgot to set a real secret must fail to start, not run with a published one.
    The error names the setting, never the value."""
    if secret is not None and _PLACEHOLDER.search(secret.get_secret_value()):
        raise ValueError(f"{what} is still a placeholder from the templates: set a real secret")
    return secret


class StoreSettings(BaseSettings):
    """How to reach Redis and how the pool's keys behave.

    Three ways to reach Redis (docs: operations/failover.md):

    * **standalone** (default): ``url`` names the one server;
    * **Sentinel**: ``sentinels`` lists the sentinels (``host:port``; env: comma-separated or a
      JSON list) and ``sentinel_service`` the monitored primary's name; ``url`` then only
      carries the database number and connection options. ``username``/``password``
      authenticate at the data nodes, ``sentinel_username``/``sentinel_password`` at the
      sentinels. The client asks the sentinels for the primary on every new connection, so it
      follows a failover by itself;
    * **Cluster**: ``cluster=True`` and ``url`` naming any node (all the pool's keys hash to
      one slot).

    Durability: the store relies on Redis persistence. Run Redis with ``appendonly yes`` and
    ``appendfsync everysec``: a Redis crash (not a restart) can lose up to ~1 s of writes, i.e.
    the last admissions/releases/transitions; a clean restart loses nothing. Writes a failover
    loses are covered by the failover epoch (:mod:`pool.store.failover`): ``wait_replicas``
    makes every fenced state change wait until that many replicas have it, and routers verify
    their in-flight bindings in every new epoch; ``failover_grace_s`` bounds how long a router
    may go without proving that to the updater.
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
    #: Memory is bounded by design (docs: operations/redis.md): a finished rollout's full record is
    #: kept ``binding_retention_s`` (about 0.5 KB each), the journal keeps its newest
    #: ``journal_maxlen`` entries (two per rollout, about 0.13 KB each) and at most
    #: ``update_records_max`` update records and the newest ``generation_records_max``
    #: declared generations (with their labels; and g0's record, the base a LoRA pool's
    #: replicas are recovered on) are kept; per-generation counts are kept for good.
    binding_retention_s: float = Field(default=600.0, gt=0)
    journal_maxlen: int = Field(default=100_000, ge=1000)
    update_records_max: int = Field(default=1000, ge=10)
    generation_records_max: int = Field(default=1000, ge=10)
    updater_lease_s: float = Field(default=15.0, gt=0)

    sentinels: ListSetting[str] = Field(default_factory=list)
    sentinel_service: str = Field(default="rolloutpool", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    sentinel_username: str | None = None
    sentinel_password: SecretStr | None = None
    cluster: bool = False
    #: Replicas that must hold each fenced state change (``WAIT``) before the updater acts on
    #: it (0: none; Sentinel deployments: the number of replicas). Not with ``cluster``.
    wait_replicas: int = Field(default=0, ge=0)
    wait_timeout_s: float = Field(default=2.0, gt=0)
    #: A router proves its in-flight bindings to the updater at least this often; one that
    #: cannot (Redis unreachable) cuts its in-flight requests after this long, and the updater
    #: starts no weight transfer until this long after it first saw a new failover epoch
    #: unless every live router has verified that epoch.
    failover_grace_s: float = Field(default=10.0, gt=0)

    @field_validator("password", "sentinel_password")
    @classmethod
    def _real_password(cls, v: SecretStr | None) -> SecretStr | None:
        return refuse_placeholder(v, "the Redis password")

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        for addr in v:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"sentinel address {addr!r} is not host:port")
        return v

    @model_validator(mode="after")
    def _one_mode(self) -> StoreSettings:
        if self.sentinels and self.cluster:
            raise ValueError("give either sentinels or cluster=true, not both")
        if self.cluster and self.wait_replicas:
            raise ValueError("wait_replicas is not supported with cluster=true")
        return self

    @property
    def mode(self) -> Literal["standalone", "sentinel", "cluster"]:
        if self.sentinels:
            return "sentinel"
        return "cluster" if self.cluster else "standalone"

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in self.sentinels]

    @property
    def safe_url(self) -> str:
        """Where Redis is, without credentials (userinfo and ``password``/``username`` query
        parameters are dropped): the only form that may appear in a log or an answer."""
        if self.sentinels:
            return f"sentinel://{','.join(self.sentinels)}/{self.sentinel_service}"
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
