"""``kubernetes``: replicas are the pods of a StatefulSet; a fresh process is a new pod.

Through the official ``kubernetes`` client (the ``k8s`` extra), with the updater's service
account; ``deploy/k8s/rbac.yaml`` grants it ``get`` and ``delete`` on the replica pods by name and
nothing else. It has not run against a live cluster: its requests are checked against the
client's own request building and a fake API server that enforces that Role
(``tests/unit/test_providers_kubernetes.py``).

* ``start``: the StatefulSet runs the pods; wait until the replica's pod is Ready (up to
  ``recreate_timeout_s``) and locate it.
* ``restart_fresh``: read the pod, ``DELETE`` it with a UID precondition (only that very pod:
  a successor the StatefulSet already made is never deleted) and ``delete_grace_s``, then read it
  every ``poll_s`` until a pod of that name with *another* UID is Ready; the StatefulSet creates
  it (fresh container, the start-up weights; the updater then loads the latest generation).
  Past ``recreate_timeout_s``: :class:`~updater.providers.base.ProviderError` with the pod's
  last phase and reason.
* ``locate``: the pod's IP (``node_address``) and node; the URL is the replica's ``url`` (e.g.
  the headless Service name, stable across pods) or ``http://<pod IP>:<port>``.
* ``incarnation``: ``pod:<uid>/container:<container id>`` (the container id also changes when
  the kubelet restarts the container in place).
* ``stop`` leaves the pods to their StatefulSet; ``alive`` is None (reading every pod on every
  health round would load the API server; a deleted pod fails its health checks anyway).

API errors become :class:`ProviderError` (403 says which permission the Role lacks). Client calls
are blocking and run in threads, each with ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Self

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from updater.config import ReplicaConfig
from updater.providers.base import Location, ProviderError, ProviderSettings, ReplicaProvider
from updater.providers.config import KubernetesConfig

__all__ = ["KubernetesProvider", "pod_ready"]


def pod_ready(pod: Any) -> bool:
    """Running, not being deleted, with an IP, and its Ready condition True."""
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None or not status.pod_ip:
        return False
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    return status.phase == "Running" and ready


class KubernetesProvider(ReplicaProvider):
    """One StatefulSet pod per replica (see the module docstring)."""

    name = "kubernetes"
    launches = False
    can_restart = True

    def __init__(
        self, config: KubernetesConfig, replicas: list[ReplicaConfig], api: Any | None = None
    ) -> None:
        self.config = config
        self._pods = {r.id: r.pod or r.id for r in replicas}
        self._urls = {r.id: r.url for r in replicas}
        self._located: dict[str, Location] = {}
        self._api = api

    @classmethod
    def from_settings(cls, settings: ProviderSettings) -> Self:
        return cls(settings.kubernetes, settings.replicas)

    def _core(self) -> Any:
        """The CoreV1Api client: in-cluster (a pod's service account) or from a kubeconfig."""
        if self._api is None:
            cfg = k8s.Configuration()
            in_cluster = self.config.in_cluster
            if in_cluster is None:
                in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ
            if in_cluster:
                k8s_config.load_incluster_config(client_configuration=cfg)
            else:
                k8s_config.load_kube_config(
                    config_file=str(self.config.kubeconfig) if self.config.kubeconfig else None,
                    context=self.config.context,
                    client_configuration=cfg,
                )
            self._api = k8s.CoreV1Api(k8s.ApiClient(cfg))
        return self._api

    async def close(self) -> None:
        if self._api is not None:
            await asyncio.to_thread(self._api.api_client.close)
            self._api = None

    def url(self, replica_id: str) -> str | None:
        loc = self._located.get(replica_id)
        return self._urls[replica_id] or (loc.url if loc is not None else None)

    # ------------------------------------------------------------------ API calls

    def _error(self, replica_id: str, verb: str, e: Exception) -> ProviderError:
        pod, ns = self._pods[replica_id], self.config.namespace
        if isinstance(e, ApiException) and e.status == 403:
            why = (
                f"forbidden: the updater's service account may not {verb} pod {pod} in "
                f"namespace {ns} (apply deploy/k8s/rbac.yaml, listing every replica pod)"
            )
        elif isinstance(e, ApiException):
            why = f"API server answered {e.status} {e.reason} to {verb} pod {pod}"
        else:
            why = f"API server unreachable ({verb} pod {pod}): {type(e).__name__}: {e}"
        return ProviderError(f"replica {replica_id}: {why}", replica=replica_id, provider=self.name)

    async def _read(self, replica_id: str) -> Any | None:
        """The replica's pod, or None if there is none (404)."""
        try:
            return await asyncio.to_thread(
                self._core().read_namespaced_pod,
                self._pods[replica_id],
                self.config.namespace,
                _request_timeout=self.config.request_timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise self._error(replica_id, "get", e) from e
        except HTTPError as e:
            raise self._error(replica_id, "get", e) from e

    async def _delete(self, replica_id: str, uid: str) -> None:
        """Delete the pod if it is still the one with ``uid`` (gone or replaced: nothing to do)."""
        body = k8s.V1DeleteOptions(
            grace_period_seconds=self.config.delete_grace_s,
            preconditions=k8s.V1Preconditions(uid=uid),
        )
        try:
            await asyncio.to_thread(
                self._core().delete_namespaced_pod,
                self._pods[replica_id],
                self.config.namespace,
                body=body,
                _request_timeout=self.config.request_timeout_s,
            )
        except ApiException as e:
            if e.status in (404, 409):  # gone already, or a successor holds the name
                return
            raise self._error(replica_id, "delete", e) from e
        except HTTPError as e:
            raise self._error(replica_id, "delete", e) from e

    def _location(self, replica_id: str, pod: Any) -> Location:
        ip = pod.status.pod_ip
        url = self._urls[replica_id] or f"http://{ip}:{self.config.port}"
        loc = Location(url, ip, pod.spec.node_name or "")
        self._located[replica_id] = loc
        return loc

    async def _wait_ready(self, replica_id: str, not_uid: str | None) -> Location:
        """Poll until the replica's pod (with a UID other than ``not_uid``) is Ready."""
        deadline = time.monotonic() + self.config.recreate_timeout_s
        last = "no pod"
        while True:
            pod = await self._read(replica_id)
            if pod is not None:
                if pod.metadata.uid != not_uid and pod_ready(pod):
                    return self._location(replica_id, pod)
                status = pod.status
                last = (
                    f"pod uid {pod.metadata.uid}, phase {status.phase if status else '?'}"
                    + (f", reason {status.reason}" if status and status.reason else "")
                    + (", being deleted" if pod.metadata.deletion_timestamp else "")
                )
            if time.monotonic() > deadline:
                what = "a successor of the deleted pod" if not_uid else "the pod"
                raise ProviderError(
                    f"replica {replica_id}: {what} {self._pods[replica_id]} was not Ready "
                    f"within {self.config.recreate_timeout_s:g} s (last seen: {last})",
                    replica=replica_id,
                    provider=self.name,
                )
            await asyncio.sleep(self.config.poll_s)

    # ------------------------------------------------------------------ the port

    async def start(self, replica_id: str) -> Location:
        return await self._wait_ready(replica_id, None)

    async def stop(self, replica_id: str) -> None:
        return None  # the StatefulSet owns the pods

    async def restart_fresh(self, replica_id: str) -> Location:
        pod = await self._read(replica_id)
        if pod is None:
            return await self._wait_ready(replica_id, None)
        old: str = pod.metadata.uid
        if pod.metadata.deletion_timestamp is None:
            await self._delete(replica_id, old)
        return await self._wait_ready(replica_id, old)

    async def locate(self, replica_id: str) -> Location:
        pod = await self._read(replica_id)
        if pod is None or not pod_ready(pod):
            raise ProviderError(
                f"replica {replica_id}: pod {self._pods[replica_id]} is not Ready",
                replica=replica_id,
                provider=self.name,
            )
        return self._location(replica_id, pod)

    async def incarnation(self, replica_id: str) -> str | None:
        try:
            pod = await self._read(replica_id)
        except ProviderError:
            return None
        if pod is None or pod.metadata.deletion_timestamp is not None:
            return None
        containers = (pod.status.container_statuses or []) if pod.status else []
        container = containers[0].container_id if containers else None
        return f"pod:{pod.metadata.uid}/container:{container}"

    async def alive(self, replica_id: str) -> None:
        return None
