"""The updater's configuration leaves: what the settings (:mod:`updater.settings`), the cycle
runner (:mod:`updater.cycle`) and the replica providers (:mod:`updater.providers`) share.

A leaf: it imports no other module of the updater besides the providers' configuration
(:mod:`updater.providers.config`), so every module may import it, the settings included.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field

from pool.launcher import ReplicaSpec
from updater.providers.config import RayPlacement


class DrainPolicy(StrEnum):
    """How a drain ends. Every drain ends: what is still bound when it ends is aborted with a
    reason (the binding's provenance says why), never dropped silently."""

    WAIT = "wait"  # let bindings end on their own, for at most drain_timeout_s
    ABORT = "abort"  # abort what is bound right away (fastest update; rollouts are cut)


class Deadlines(BaseModel):
    """Per-step deadlines in seconds (I5). Every engine call of a cycle runs under one."""

    preflight_s: float = Field(default=60.0, gt=0)
    pause_s: float = Field(default=60.0, gt=0)
    transfer_s: float = Field(default=300.0, gt=0)
    reset_s: float = Field(default=30.0, gt=0)
    validate_s: float = Field(default=60.0, gt=0)
    resume_s: float = Field(default=30.0, gt=0)


class ReplicaConfig(BaseModel):
    """One replica the updater manages.

    ``model`` is the checkpoint the server was started with: its manifest is the one every
    pushed checkpoint must match. What else a replica needs depends on the pool's provider
    (``UpdaterSettings.provider``, :mod:`updater.providers`):

    * ``local``: ``launch`` (the updater starts the process and restarts it for recovery); with
      a ``url`` too, that is where the updater and routers reach it (e.g. through a proxy);
    * ``external``: ``url`` only (someone else runs it; recovery waits for its orchestrator);
    * ``ray``: ``launch`` (what its actor runs) and optionally ``ray`` (its resource request and
      placement; default ``UpdaterSettings.ray.placement``); no ``url``: placement decides it;
    * ``kubernetes``: ``pod`` (default: the id) and optionally ``url`` (e.g. the headless
      Service name; default the pod's IP).
    """

    model_config = {"extra": "forbid"}

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    url: str | None = None
    model: Path
    launch: ReplicaSpec | None = None
    capacity: int = Field(default=64, ge=1)
    ray: RayPlacement | None = None
    pod: str | None = Field(default=None, pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
