"""Updater settings (pydantic-settings; env prefix ``ROLLOUTPOOL_UPDATER_``, nested with ``__``).

Built once in ``__main__`` (or by the CLI) and passed down; nothing else reads the environment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pool.settings import refuse_placeholder
from updater.config import Deadlines, DrainPolicy, ReplicaConfig
from updater.providers import registry as providers
from updater.providers.config import KubernetesConfig, RayConfig
from updater.transports import registry as transports
from updater.transports.nccl.config import NcclConfig

#: ``ReplicaConfig`` (defined with the other configuration leaves, :mod:`updater.config`) is the
#: type of ``UpdaterSettings.replicas``, so it is exported here too.
__all__ = ["ReplicaConfig", "UpdaterSettings"]

#: Built-in provider -> (the replica fields it needs, the fields it has no use for).
_REQUIRED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "local": (frozenset({"launch"}), frozenset({"ray", "pod"})),
    "external": (frozenset({"url"}), frozenset({"launch", "ray", "pod"})),
    "ray": (frozenset({"launch"}), frozenset({"url", "pod"})),
    "kubernetes": (frozenset(), frozenset({"launch", "ray"})),
}


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

    #: Who runs the replicas: a name registered in :mod:`updater.providers.registry`. Built in:
    #: ``local``, ``external``, ``ray`` (settings in ``ray``), ``kubernetes`` (``kubernetes``).
    #: ``auto`` (the default) is ``local`` when every replica has a ``launch`` spec and
    #: ``external`` when none has; after validation it is always a registered name.
    provider: str = "auto"
    ray: RayConfig = Field(default_factory=RayConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)

    @field_validator("admin_token")
    @classmethod
    def _real_token(cls, v: SecretStr | None) -> SecretStr | None:
        return refuse_placeholder(v, "the updater admin token")

    @field_validator("transport")
    @classmethod
    def _registered_transport(cls, name: str) -> str:
        return transports.require(name)  # validates the name; imports no transport

    @model_validator(mode="after")
    def _replicas_fit_the_provider(self) -> UpdaterSettings:
        if self.provider == "auto":
            launched = {r.launch is not None for r in self.replicas}
            if len(launched) > 1:
                raise ValueError(
                    "some replicas have a launch spec and some do not: set provider "
                    "(local, external, ray, kubernetes) and give every replica what it needs"
                )
            self.provider = "local" if launched == {True} else "external"
        providers.require(self.provider)  # validates the name; imports no provider
        required, forbidden = _REQUIRED.get(self.provider, (frozenset(), frozenset()))
        for r in self.replicas:
            given = {k for k in ("url", "launch", "ray", "pod") if getattr(r, k) is not None}
            if missing := sorted(required - given):
                raise ValueError(f"replica {r.id}: provider {self.provider} needs {missing}")
            if extra := sorted(given & forbidden):
                raise ValueError(f"replica {r.id}: provider {self.provider} does not use {extra}")
        return self

    #: What a generation is: ``weights`` (every update replaces the model's weights, one
    #: drained replica at a time) or ``lora`` (the base model is fixed and every update is a
    #: PEFT LoRA adapter loaded beside the served ones on every replica, no drain:
    #: :mod:`updater.lora`). ``lora`` needs every launched replica started with ``max_loras``
    #: of at least ``max_staleness + 2`` and a ``max_lora_rank`` of at least this one's;
    #: the routers must say the same (``RouterSettings.generations``).
    generations: Literal["weights", "lora"] = "weights"
    #: ``lora``: the highest adapter rank a push may have (checked before anything is loaded).
    max_lora_rank: int = Field(default=16, ge=1)
    #: ``lora``: how often adapters nothing holds any more are looked for and unloaded (s).
    retire_interval_s: float = Field(default=1.0, gt=0)
    #: ``lora``: beside the probe, compare the factors the replica's workers hold with the
    #: adapter directory's (:mod:`pool.adapter_sums`); an adapter that differs is unloaded and
    #: not admitted. The replicas must run RolloutPool's worker extension
    #: (``--worker-extension-cls pool.replica_extension.WeightExtension``).
    lora_checksums: bool = False

    @model_validator(mode="after")
    def _first_wave_fits(self) -> UpdaterSettings:
        if self.first_wave > self.max_unavailable:
            raise ValueError(
                f"first_wave {self.first_wave} exceeds max_unavailable {self.max_unavailable}"
            )
        return self

    @model_validator(mode="after")
    def _lora_replicas(self) -> UpdaterSettings:
        if self.generations != "lora":
            return self
        for r in self.replicas:
            spec = r.launch
            if spec is None:
                continue  # someone else starts it: its flags are theirs to set
            if spec.max_loras is None or spec.max_loras < self.max_staleness + 2:
                raise ValueError(
                    f"replica {r.id}: generations=lora needs launch.max_loras >= "
                    f"max_staleness + 2 = {self.max_staleness + 2} (got {spec.max_loras})"
                )
            if spec.max_lora_rank < self.max_lora_rank:
                raise ValueError(
                    f"replica {r.id}: launch.max_lora_rank {spec.max_lora_rank} is below "
                    f"max_lora_rank {self.max_lora_rank}"
                )
        return self

    #: The rolling plan (:mod:`updater.plan`): at most this many replicas out of READY at once,
    #: never fewer than ``min_serving`` admitting.
    max_unavailable: int = Field(default=1, ge=1)
    min_serving: int = Field(default=1, ge=0)
    #: How many replicas update to a new generation before it is published, together; the
    #: first of them to pass validation publishes it. 1 (the default): one replica proves a
    #: checkpoint while the rest serve the current generation. More: they drain and update at
    #: once and each returns as soon as it is ready, which with ``max_staleness`` 0 (publishing
    #: closes every replica still on the old generation anyway) shortens the roll; a checkpoint
    #: that fails validation then taints up to this many replicas (recovery brings them back).
    #: At most ``max_unavailable``.
    first_wave: int = Field(default=1, ge=1)
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
