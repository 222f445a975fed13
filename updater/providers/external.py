"""``external``: replicas someone else runs (compose, systemd, a hand-started server), by URL.

The updater neither starts nor stops them and cannot restart one: ``restart_fresh`` raises, and
the supervisor keeps a TAINTED replica quarantined, its reason saying that its orchestrator must
restart it, until the engine reports another server process (I6). There is no provider-side
identity (``incarnation`` is None) and no liveness knowledge (``alive`` is None): the engine's
own process identity and the health checks are all the evidence there is.
"""

from __future__ import annotations

from typing import Self
from urllib.parse import urlsplit

from updater.config import ReplicaConfig
from updater.providers.base import Location, ProviderError, ProviderSettings, ReplicaProvider

__all__ = ["ExternalProvider"]


class ExternalProvider(ReplicaProvider):
    """Replicas by URL only (see the module docstring)."""

    name = "external"
    launches = False
    can_restart = False

    def __init__(self, replicas: list[ReplicaConfig]) -> None:
        self._urls: dict[str, str] = {}
        for r in replicas:
            if r.url is None:
                raise ValueError(f"replica {r.id}: the external provider needs a url")
            self._urls[r.id] = r.url

    @classmethod
    def from_settings(cls, settings: ProviderSettings) -> Self:
        return cls(settings.replicas)

    def url(self, replica_id: str) -> str:
        return self._urls[replica_id]

    async def start(self, replica_id: str) -> Location:
        return await self.locate(replica_id)

    async def stop(self, replica_id: str) -> None:
        return None

    async def restart_fresh(self, replica_id: str) -> Location:
        raise ProviderError(
            f"replica {replica_id} is run by someone else: restart it through its orchestrator",
            replica=replica_id,
            provider=self.name,
        )

    async def locate(self, replica_id: str) -> Location:
        url = self._urls[replica_id]
        return Location(url, urlsplit(url).hostname or "")

    async def incarnation(self, replica_id: str) -> None:
        return None

    async def alive(self, replica_id: str) -> None:
        return None
