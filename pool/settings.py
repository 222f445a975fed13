"""Settings shared by router and updater (pydantic-settings; env prefix ``ROLLOUTPOOL_``).

Built once in each ``__main__`` and passed down; nothing else reads the environment.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    binding_lease_s: float = Field(default=60.0, gt=0)
    binding_retention_s: float = Field(default=7 * 24 * 3600, gt=0)
    journal_maxlen: int = Field(default=1_000_000, ge=1000)
    updater_lease_s: float = Field(default=15.0, gt=0)
