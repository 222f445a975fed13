"""Updater settings (pydantic-settings; env prefix ``ROLLOUTPOOL_UPDATER_``, nested with ``__``).

Built once in ``__main__`` (or by the CLI) and passed down; nothing else reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pool.launcher import ReplicaSpec
from updater.cycle import Deadlines, DrainPolicy
from updater.transports import registry as transports
from updater.transports.nccl import NcclConfig


class ReplicaConfig(BaseModel):
    """One replica the updater manages.

    ``model`` is the checkpoint the server was started with: its manifest is the one every
    pushed checkpoint must match. With ``launch`` the updater starts the process itself and can
    restart it for recovery (local launcher); without it, ``url`` must point at a running server
    and recovery needs an external supervisor (Kubernetes replaces the pod). With both, ``url``
    is where the updater and routers reach the launched server (e.g. through a proxy).
    """

    model_config = {"extra": "forbid"}

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str | None = None
    model: Path
    launch: ReplicaSpec | None = None
    capacity: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _url_or_launch(self) -> ReplicaConfig:
        if self.url is None and self.launch is None:
            raise ValueError(f"replica {self.id}: give a url or a launch spec")
        return self


class UpdaterSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ROLLOUTPOOL_UPDATER_", env_nested_delimiter="__", extra="forbid"
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8300, ge=0, le=65535)
    admin_token: SecretStr | None = None
    replicas: list[ReplicaConfig] = Field(default_factory=list)

    #: A name registered in :mod:`updater.transports.registry`. Built in: ``reload``: replicas
    #: load the pushed checkpoint path themselves (CPU and GPU; the path must be readable by the
    #: servers); ``nccl``: the updater loads it onto its GPU and broadcasts through vLLM's
    #: weight-transfer engine (service mode; see ``nccl``).
    transport: str = "reload"
    nccl: NcclConfig = Field(default_factory=NcclConfig)
    #: ``reload``: prove every update by per-parameter checksums of the checkpoint against the
    #: replica's runtime weights (the replicas must run ``--worker-extension-cls
    #: pool.replica_extension.WeightExtension``). ``nccl_direct`` always does.
    checksums: bool = False

    @field_validator("transport")
    @classmethod
    def _registered_transport(cls, name: str) -> str:
        return transports.require(name)  # validates the name; imports no transport

    max_unavailable: int = Field(default=1, ge=1)
    min_serving: int = Field(default=1, ge=0)
    max_staleness: int = Field(default=0, ge=0)  # must match the routers' setting
    drain_policy: DrainPolicy = DrainPolicy.WAIT
    drain_timeout_s: float = Field(default=300.0, gt=0)
    deadlines: Deadlines = Field(default_factory=Deadlines)

    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    health_failures: int = Field(default=2, ge=1)
    recover: bool = True

    #: Prompt of the validation probe for the initial generation (its expected output is taken
    #: from the first replica and every other replica must match it).
    initial_probe_prompt: tuple[int, ...] = tuple(range(10, 26))
    initial_probe_tokens: int = Field(default=8, ge=1)
    initial_label: str = "g0"
