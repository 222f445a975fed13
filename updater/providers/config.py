"""Settings of the Ray and Kubernetes providers (pydantic; no ``ray`` or Kubernetes import).

``UpdaterSettings.ray`` / ``UpdaterSettings.kubernetes`` hold the pool-wide part; a replica's own
part is ``ReplicaConfig.ray`` (its resource request and placement) or ``ReplicaConfig.pod``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["KubernetesConfig", "RayConfig", "RayPlacement"]


class RayPlacement(BaseModel):
    """One replica's Ray actor: what it reserves and where it may run.

    The actor holds ``num_cpus``/``num_gpus``/``memory_bytes``/``resources`` for its lifetime
    (its server process inherits the GPUs Ray assigns it). Where it runs, one of:

    * ``placement_group`` (+ ``bundle_index``): a bundle of a placement group created elsewhere
      (e.g. by the RL framework that reserves the GPUs), looked up by name;
    * ``prefer_node_labels``: soft node affinity: an alive node with these Ray node labels
      (``ray start --labels``) if there is one, else any node where the resources fit. After
      a node is lost, the replica is placed again on another node "when resources allow";
    * ``label_selector``: hard: only nodes with these labels (the actor waits for one).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    memory_bytes: int | None = Field(default=None, gt=0)
    resources: dict[str, float] = Field(default_factory=dict)
    prefer_node_labels: dict[str, str] = Field(default_factory=dict)
    label_selector: dict[str, str] = Field(default_factory=dict)
    placement_group: str | None = None
    bundle_index: int = Field(default=-1, ge=-1)

    @model_validator(mode="after")
    def _one_placement(self) -> RayPlacement:
        if self.placement_group is not None and (self.prefer_node_labels or self.label_selector):
            raise ValueError("a placement group decides the node: no node labels with it")
        if self.prefer_node_labels and self.label_selector:
            raise ValueError("prefer_node_labels (soft) or label_selector (hard), not both")
        return self


class RayConfig(BaseModel):
    """The Ray provider (``provider: ray``): one actor per replica, named
    ``<actor_prefix>-<replica id>`` in Ray namespace ``namespace``.

    ``address`` None: the Ray the process is already part of (inside a Ray job, or
    ``RAY_ADDRESS``), else ``ray.init(address)`` (``"auto"``, ``"<head>:6379"``, or
    ``"ray://<head>:10001"`` through Ray Client). ``detached`` actors outlive the updater process,
    so a restarted updater adopts the replicas that are still the validated process; stopping
    the updater with its replicas kills them. ``placement_timeout_s``: an actor that is not
    placed by then (no node has the resources) is killed and the start fails (PlacementError).
    ``cpu_bind_env``: a variable that, set in a node's ``ray start`` environment, replaces
    ``launch.cpu_bind`` for CPU replicas placed on that node: ``;``-separated core sets, one per
    replica the node can host (``"0-3;4-7"``); each replica's actor claims a free one.
    """

    model_config = ConfigDict(extra="forbid")

    address: str | None = None
    namespace: str = "rolloutpool"
    actor_prefix: str = Field(default="rolloutpool", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    detached: bool = True
    placement: RayPlacement = Field(default_factory=RayPlacement)
    placement_timeout_s: float = Field(default=120.0, gt=0)
    call_timeout_s: float = Field(default=10.0, gt=0)
    cpu_bind_env: str | None = "ROLLOUTPOOL_CPU_BIND"
    runtime_env: dict[str, Any] = Field(default_factory=dict)


class KubernetesConfig(BaseModel):
    """The Kubernetes provider (``provider: kubernetes``): replicas are the pods of a
    StatefulSet in ``namespace``; a replica's pod is ``ReplicaConfig.pod`` (default: its id).

    ``in_cluster`` None: the in-cluster service account when running in a pod, else
    ``kubeconfig`` (default ``~/.kube/config``) and ``context``. A replica without a ``url`` is
    reached at ``http://<pod IP>:<port>``. A restart deletes the pod with ``delete_grace_s`` and
    waits up to ``recreate_timeout_s`` for its successor to be Ready (a cold start of a large
    model takes minutes), reading the pod every ``poll_s``.
    """

    model_config = ConfigDict(extra="forbid")

    namespace: str = "rolloutpool"
    in_cluster: bool | None = None
    kubeconfig: Path | None = None
    context: str | None = None
    port: int = Field(default=8000, ge=1, le=65535)
    delete_grace_s: int = Field(default=30, ge=0)
    recreate_timeout_s: float = Field(default=1800.0, gt=0)
    poll_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
