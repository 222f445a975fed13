"""Router settings (pydantic-settings; env prefix ``ROLLOUTPOOL_ROUTER_``).

Built once in :mod:`router.__main__` and passed to :func:`router.app.create_app`; nothing else
reads the environment. Secrets are :class:`~pydantic.SecretStr`, so they never appear in a
``repr``, a log line or ``/metrics``.

``ROLLOUTPOOL_ROUTER_API_KEYS`` accepts a JSON list (``'["k1","k2"]'``) or a comma-separated
string (``k1,k2``). An empty list disables client authentication.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pool.settings import ListSetting, refuse_placeholder

MIB = 1024 * 1024


class RouterSettings(BaseSettings):
    """Everything the router needs besides the store (:class:`pool.settings.StoreSettings`).

    ``workers`` (``python -m router --workers N`` overrides it): processes serving ``port``
    together with ``SO_REUSEPORT`` (:mod:`router.workers`), each a whole router; 0 means one
    per core. Each worker applies ``client_max_in_flight`` and the rate limit to its own
    requests (``session_max_in_flight`` is kept in Redis, for all of them); its ``/metrics``
    are its own (a scrape through the shared port reaches one worker) and ``/healthz`` names it
    (``worker``: index, count, pid).

    Timing contracts:

    * ``admission_wait_s`` bounds how long a request queues for an eligible replica before it
      is answered 503 with ``Retry-After: retry_after_s``.
    * ``upstream_timeout_s`` bounds every *silence* of an upstream replica (no byte for that
      long: the whole generation of a non-streamed request, the gap between two SSE chunks of a
      streamed one); it ends in 504 / an aborted binding.
    * ``request_lease_s`` is the lease of a one-request rollout; the router renews it every
      third of that while the request runs, so only a dead router's bindings expire (and are
      aborted by any router's reaper within ``reaper_interval_s``).
    * ``session_lease_s`` is a session's lease; every request and heartbeat renews it.
    * ``grants`` (on by default): one-request rollouts are admitted against capacity this router
      holds in advance per replica (``grant_slots`` slots at first, grown and shrunk with its
      load, at most the replica's capacity), with no Redis round trip on the request's path;
      their provenance records are written after delivery, every ``record_flush_s``
      (:mod:`router.grants`, :mod:`router.records`). Off: one ADMIT and one RELEASE script
      per request, as sessions always use.
    * ``replica_view_ttl_s``: how long one snapshot of the pool view (kept current by the
      change feed, :mod:`pool.store.feed`) is reused for ordering candidates.
    * ``upstream_keepalive_s`` must stay below vLLM's own keep-alive (5 s by default,
      ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), or a pooled connection can be closed by the server
      just as a request is written on it.

    Limits on clients (docs: operations/security.md), so that no client can hold a
    replica's drain or the pool's capacity indefinitely:

    * ``session_max_age_s`` ends a session that long after it opened, heartbeats or not
      (``aborted``, "session reached its maximum age of ... s"); ``session_idle_s`` ends one
      that had no request for that long (heartbeats keep its lease, not its activity).
      Both are kept in Redis, so every router and reaper agrees.
    * ``client_max_sessions``: open sessions per client identity (``key:<fingerprint>``, or
      ``anonymous:<address>`` without keys; the admin is exempt), counted in Redis across
      routers; ``client_max_in_flight``: requests per client identity in flight in *this*
      router (arrival to last byte, queueing for a replica included); ``session_max_in_flight``:
      concurrent requests of one session across every worker and router (kept in Redis, each
      request's mark under a lease of ``request_lease_s`` renewed while it runs, so a dead
      worker's lapses: :mod:`router.session_runs`; 1: a session counts as one rollout against
      its replica's capacity, as its binding does). Over any of them → 429 with
      ``Retry-After``; 0 disables one.
    * The two client quotas default to unset (None): **derived from the pool's capacity** as the
      router sees it at admission (:func:`router.limits.pool_capacity`, the capacity of every
      replica not out of service), ``client_max_sessions`` = half of it (at least 1) and
      ``client_max_in_flight`` = all of it (no limit while it is 0: requests wait for a
      replica, then 503). Chosen over charging a session
      only from its first request because a session holds its replica's slot while it idles
      between requests whatever it did first, and the ADMIT script, the drain and the
      updater's accounting all count a session binding from its admission: with half the pool
      per client, one client's idle sessions can never take the whole pool, whatever its size,
      while one trainer may still fill it with requests. Set a value to fix a quota (0
      disables it).
    * A request asks its replica for ``n`` (or ``best_of``) sequences per prompt, times the
      prompts of a prompt array (:func:`router.limits.sequences`): a one-request rollout under
      ``grants`` is charged that many slots of its replica; a session's request, or any
      request with ``grants`` off (one binding: one slot), must ask for one (400
      ``one_sequence_per_request``), and no request may ask for more than the largest
      replica's capacity (400 ``too_many_sequences``).
    * ``request_deadline_s`` bounds a whole request, stream included (504 / an SSE error event;
      the binding is aborted with the reason); a session's request also ends at the session's
      maximum age. ``client_write_timeout_s``: a stream the client does not read for that long
      is ended ("client stopped reading"), its connection closed.
    * ``max_body_bytes`` caps a request body (413), ``max_upstream_body_bytes`` a replica's
      whole (non-streamed) answer (502).
    """

    model_config = SettingsConfigDict(env_prefix="ROLLOUTPOOL_ROUTER_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    workers: int = Field(default=1, ge=0)
    api_keys: ListSetting[SecretStr] = Field(default_factory=list)
    admin_token: SecretStr | None = None
    served_model_name: str = Field(default="rolloutpool", min_length=1)

    max_staleness: int = Field(default=0, ge=0)
    #: What a generation is; must match the updater's ``generations``. ``lora``: generation
    #: g >= 1 is a LoRA adapter every replica serves beside the others, and each request is
    #: sent with ``model`` = its rollout's adapter (``rp-<number>-<label>``; g0 the base
    #: model), whose answer must name it (else a provenance violation).
    generations: Literal["weights", "lora"] = "weights"
    admission_wait_s: float = Field(default=5.0, ge=0)
    retry_after_s: int = Field(default=1, ge=0)
    replica_view_ttl_s: float = Field(default=0.25, ge=0)
    grants: bool = True
    grant_slots: int = Field(default=4, ge=1)
    record_flush_s: float = Field(default=0.02, gt=0)
    max_body_bytes: int = Field(default=4 * MIB, gt=0)
    max_upstream_body_bytes: int = Field(default=64 * MIB, gt=0)

    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    upstream_keepalive_s: float = Field(default=4.0, gt=0)
    upstream_connections: int = Field(default=512, gt=0)
    upstream_api_key: SecretStr | None = None

    session_lease_s: float = Field(default=300.0, gt=0)
    request_lease_s: float = Field(default=30.0, gt=0)
    reaper_interval_s: float = Field(default=5.0, gt=0)

    session_max_age_s: float = Field(default=3600.0, gt=0)
    session_idle_s: float = Field(default=600.0, gt=0)
    client_max_sessions: int | None = Field(default=None, ge=0)
    client_max_in_flight: int | None = Field(default=None, ge=0)
    session_max_in_flight: int = Field(default=1, ge=0)
    request_deadline_s: float = Field(default=1800.0, gt=0)
    client_write_timeout_s: float = Field(default=30.0, gt=0)

    rate_limit_per_s: float | None = Field(default=None, gt=0)
    rate_limit_burst: int = Field(default=200, gt=0)

    log_level: str = "INFO"

    @field_validator("api_keys")
    @classmethod
    def _no_empty_keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        if any(not k.get_secret_value() for k in v):
            raise ValueError("api_keys must not contain an empty key")
        for i, key in enumerate(v):
            refuse_placeholder(key, f"api key #{i + 1}")
        return v

    @field_validator("admin_token")
    @classmethod
    def _real_admin_token(cls, v: SecretStr | None) -> SecretStr | None:
        return refuse_placeholder(v, "the router admin token")

    @model_validator(mode="after")
    def _admin_is_not_a_client_key(self) -> RouterSettings:
        if self.admin_token is not None:
            admin = self.admin_token.get_secret_value()
            if not admin:
                raise ValueError("admin_token must not be empty (unset it to disable admin)")
            if any(k.get_secret_value() == admin for k in self.api_keys):
                raise ValueError("admin_token must differ from every client api key")
        return self
