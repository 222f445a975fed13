"""The Kubernetes provider through the official ``kubernetes`` client, against a fake API server.

No cluster can run here, so this is as far as the check honestly goes: the provider's calls go
through the real client (its request building, auth header, serialisation of ``V1DeleteOptions``,
deserialisation of pods into ``V1Pod``, its ``ApiException`` on errors) to a small in-process
HTTP server that plays the API server's part for pods: ``GET`` and ``DELETE`` on
``/api/v1/namespaces/<ns>/pods/<name>``, UID preconditions (409), 404 for a missing pod, and a
StatefulSet that recreates a deleted pod with a new UID and IP. It authorizes every request
against the Role in ``deploy/k8s/rbac.yaml`` (verbs and resource names), answering 403 like the
real RBAC authorizer, so these tests also show that the shipped Role allows exactly what the
provider does. What the fake does not prove: the real API server's behaviour (timing, eviction,
the kubelet), which has not been run.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kubernetes", reason="the k8s extra is not installed (pip install -e '.[k8s]')")

from kubernetes import client as k8s

from updater.providers.base import ProviderError
from updater.providers.config import KubernetesConfig
from updater.providers.kubernetes import KubernetesProvider
from updater.settings import ReplicaConfig

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "rbac.yaml"
NS = "rolloutpool"
TOKEN = "test-service-account-token"
POD_PATH = f"/api/v1/namespaces/{NS}/pods/"


def role_rules() -> list[dict[str, Any]]:
    docs = list(yaml.safe_load_all(RBAC.read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    rules: list[dict[str, Any]] = role["rules"]
    return rules


@dataclass
class FakeCluster:
    """Pods by name; a deleted pod is recreated by 'the StatefulSet' after ``recreate_reads``
    reads of it (None: never). Every request is recorded as (verb, name, body, auth header)."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    recreate_reads: int | None = 2
    requests: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    denied: list[tuple[str, str]] = field(default_factory=list)
    _pending: dict[str, int] = field(default_factory=dict)
    _n: int = 0

    def make_pod(self, name: str) -> dict[str, Any]:
        self._n += 1
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4())},
            "spec": {
                "nodeName": f"gpu-node-{self._n}",
                "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.26.0"}],
            },
            "status": {
                "phase": "Running",
                "podIP": f"198.51.100.{self._n}",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.26.0",
                        "imageID": "sha256:0",
                        "ready": True,
                        "restartCount": 0,
                        "containerID": f"containerd://{uuid.uuid4().hex}",
                    }
                ],
            },
        }
        self.pods[name] = pod
        return pod

    def allowed(self, verb: str, name: str) -> bool:
        return any(
            "" in r["apiGroups"]
            and "pods" in r["resources"]
            and verb in r["verbs"]
            and name in r.get("resourceNames", [name])
            for r in role_rules()
        )

    def get(self, name: str) -> tuple[int, dict[str, Any]]:
        if name in self._pending:
            self._pending[name] -= 1
            if self._pending[name] <= 0:
                del self._pending[name]
                return 200, self.make_pod(name)
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        if name not in self.pods:
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        return 200, self.pods[name]

    def delete(self, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        pod = self.pods.get(name)
        if pod is None:
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        want = (body.get("preconditions") or {}).get("uid")
        if want is not None and want != pod["metadata"]["uid"]:
            msg = f"Precondition failed: UID in precondition: {want}, UID in object meta: "
            return 409, status(409, "Conflict", msg + pod["metadata"]["uid"])
        del self.pods[name]
        if self.recreate_reads is not None:
            self._pending[name] = self.recreate_reads
        return 200, pod


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, verb: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            path = self.path.split("?")[0]
            auth = self.headers.get("Authorization")
            name = path.removeprefix(POD_PATH)
            cluster.requests.append((verb, path, body, auth))
            if not path.startswith(POD_PATH) or "/" in name:
                code, out = 404, status(404, "NotFound", "the fake serves pods only")
            elif auth != f"Bearer {TOKEN}":
                code, out = 401, status(401, "Unauthorized", "Unauthorized")
            elif not cluster.allowed(verb, name):
                cluster.denied.append((verb, name))
                msg = (
                    f'pods "{name}" is forbidden: User "system:serviceaccount:{NS}:updater" '
                    f'cannot {verb} resource "pods" in API group "" in the namespace "{NS}"'
                )
                code, out = 403, status(403, "Forbidden", msg)
            elif verb == "get":
                code, out = cluster.get(name)
            else:
                code, out = cluster.delete(name, body or {})
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("get")

        def do_DELETE(self) -> None:
            self._answer("delete")

    return Handler


@pytest.fixture
def cluster() -> Iterator[tuple[FakeCluster, str]]:
    fake = FakeCluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(fake))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def provider(url: str, *pods: str, timeout_s: float = 5.0) -> KubernetesProvider:
    cfg = k8s.Configuration(host=url, api_key={"authorization": TOKEN})
    cfg.api_key_prefix = {"authorization": "Bearer"}
    api = k8s.CoreV1Api(k8s.ApiClient(cfg))
    settings = KubernetesConfig(namespace=NS, poll_s=0.01, recreate_timeout_s=timeout_s)
    replicas = [ReplicaConfig(id=p, model=Path("/checkpoints/initial")) for p in pods]
    return KubernetesProvider(settings, replicas, api=api)


async def test_restart_deletes_that_pod_and_waits_for_its_successor(
    cluster: tuple[FakeCluster, str],
) -> None:
    fake, url = cluster
    old = fake.make_pod("replica-1")
    p = provider(url, "replica-1")
    first = await p.start("replica-1")
    assert (first.url, first.node_address) == ("http://198.51.100.1:8000", "198.51.100.1")
    before = await p.incarnation("replica-1")
    assert before is not None and before.startswith(f"pod:{old['metadata']['uid']}/container:")

    loc = await p.restart_fresh("replica-1")
    new = fake.pods["replica-1"]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert (loc.url, loc.node_address, loc.node) == (
        "http://198.51.100.2:8000",
        "198.51.100.2",
        "gpu-node-2",
    )
    assert await p.incarnation("replica-1") not in (None, before)
    deletes = [(path, body) for verb, path, body, _ in fake.requests if verb == "delete"]
    # one DELETE of exactly that pod, only if it is still the one read (UID precondition)
    assert deletes == [
        (
            POD_PATH + "replica-1",
            {
                "gracePeriodSeconds": 30,
                "preconditions": {"uid": old["metadata"]["uid"]},
            },
        )
    ]
    assert {auth for *_, auth in fake.requests} == {f"Bearer {TOKEN}"}
    assert fake.denied == []  # the shipped Role allows every request the provider made
    await p.close()


async def test_a_successor_already_there_is_not_deleted(cluster: tuple[FakeCluster, str]) -> None:
    """Between the read and the DELETE the StatefulSet replaced the pod: the UID precondition
    makes the API server refuse (409) and the provider takes the successor as the fresh one."""
    fake, url = cluster
    fake.make_pod("replica-0")
    p = provider(url, "replica-0")
    original = p._read

    async def read_then_replace(replica_id: str) -> Any:
        pod = await original(replica_id)
        fake.make_pod("replica-0")  # a successor with a new UID appears
        return pod

    p._read = read_then_replace  # type: ignore[method-assign]
    first_uid = (await original("replica-0")).metadata.uid
    loc = await p.restart_fresh("replica-0")
    p._read = original  # type: ignore[method-assign]
    assert [verb for verb, *_ in fake.requests].count("delete") == 1
    assert "replica-0" in fake.pods and fake.pods["replica-0"]["metadata"]["uid"] != first_uid
    assert loc.node_address.startswith("198.51.100.")


async def test_a_pod_outside_the_role_is_forbidden_with_a_clear_reason(
    cluster: tuple[FakeCluster, str],
) -> None:
    fake, url = cluster
    fake.make_pod("replica-7")  # not in rbac.yaml's resourceNames
    p = provider(url, "replica-7")
    with pytest.raises(ProviderError, match=r"may not get pod replica-7 .*\(apply deploy/k8s/rbac"):
        await p.restart_fresh("replica-7")
    assert fake.denied == [("get", "replica-7")]
    assert "replica-7" in fake.pods  # nothing was deleted


async def test_no_successor_in_time_says_what_was_last_seen(
    cluster: tuple[FakeCluster, str],
) -> None:
    fake, url = cluster
    fake.recreate_reads = None  # the StatefulSet never recreates it (scaled down, no quota...)
    fake.make_pod("replica-0")
    p = provider(url, "replica-0", timeout_s=0.3)
    with pytest.raises(ProviderError, match=r"successor .* not Ready within 0.3 s .*no pod"):
        await p.restart_fresh("replica-0")


async def test_start_waits_for_a_ready_pod(cluster: tuple[FakeCluster, str]) -> None:
    fake, url = cluster
    pod = fake.make_pod("replica-0")
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    p = provider(url, "replica-0", timeout_s=0.3)
    with pytest.raises(ProviderError, match=r"the pod replica-0 was not Ready .*phase Running"):
        await p.start("replica-0")
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert (await p.start("replica-0")).node_address == pod["status"]["podIP"]
