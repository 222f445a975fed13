"""``deploy/`` checked offline: every YAML and JSON file parses, and the compose file, the
Kubernetes manifests, the Prometheus scrape configs and the Grafana dashboard have the structure
the pool relies on. The updater configs validate against the real settings classes, and every
dashboard query refers only to metrics that ``pool/metrics.py`` (or vLLM) exports.

No docker, kubectl or network: structural checks in Python only.
"""

from __future__ import annotations

import builtins
import copy
import functools
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pool.metrics import RouterMetrics, UpdaterMetrics
from pool.settings import StoreSettings
from router.settings import RouterSettings
from updater.cycle import Deadlines
from updater.settings import ReplicaConfig, UpdaterSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
NAMESPACE = "rolloutpool"
REPLICAS = ("replica-0", "replica-1")
CHECKPOINTS = "/checkpoints"

#: vLLM metrics the dashboard may use (shared/reference/vllm-api.md, stable over 0.26-0.33).
VLLM_METRICS = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    }
)


# ------------------------------------------------------------------------------------ helpers


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def _parse(path: Path) -> tuple[Any, ...]:
    return tuple(d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d is not None)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def load_yaml(path: Path) -> list[Any]:
    """Every non-empty document of a (possibly multi-document) YAML file (a fresh copy)."""
    return copy.deepcopy(list(_parse(path)))


def env_default(value: str) -> str:
    """The default of a compose ``${VAR:-default}`` (the value itself if it is a literal)."""
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    return m.group(1) if m else value


def vllm_version(tag: str) -> tuple[int, int]:
    m = re.fullmatch(r"v?0\.(\d+)\.\d+(?:\.post\d+)?", tag)
    assert m, f"not a pinned vLLM release tag: {tag!r}"
    return 0, int(m.group(1))


def in_supported_range(tag: str) -> bool:
    return (0, 26) <= vllm_version(tag) <= (0, 33)


def compose_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def mounts(svc: dict[str, Any]) -> list[dict[str, Any]]:
    """Compose volumes in long form (short ``src:dst[:ro]`` strings converted)."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            out.append(
                {
                    "source": parts[0],
                    "target": parts[1],
                    "read_only": len(parts) > 2 and "ro" in parts[2].split(","),
                }
            )
        else:
            out.append(v)
    return out


def k8s_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of a nested dict/list structure."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


# PromQL: what is left after removing strings, label matchers, ranges, grouping clauses and
# Grafana variables, minus function names and keywords, are metric names.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    }
)


def promql_metric_names(expr: str) -> set[str]:
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        before = text[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":  # exponent of a number (1e3) or a duration
            continue
        if text[m.end() :].lstrip().startswith("("):  # function or aggregation
            continue
        if m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


def exposed_metric_names() -> set[str]:
    """Sample names the router and the updater expose, from the real metric definitions.

    Labelled metrics have no samples until a label set is used, so names are derived from each
    family's type with prometheus_client's exposition suffixes; the samples that do exist
    (unlabelled metrics) cross-check that derivation.
    """
    names: set[str] = set()
    sampled: set[str] = set()
    for create in (RouterMetrics.create, UpdaterMetrics.create):
        registry = CollectorRegistry()  # both build the pool gauges: one registry each
        create(registry)
        for family in registry.collect():
            names |= {family.name + s for s in _SUFFIXES[family.type]}
            sampled |= {s.name for s in family.samples}
    assert sampled, "expected some unlabelled metrics to expose samples"
    assert sampled <= names, sampled - names
    return names


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = load_yaml(DEPLOY / "docker-compose.yml")
    return doc  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def k8s() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += load_yaml(path)
    return docs


def k8s_obj(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "rolloutpool.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ROLLOUTPOOL_* variable of the test runner leaks into the settings under test."""
    import os

    for key in list(os.environ):
        if key.startswith("ROLLOUTPOOL_"):
            monkeypatch.delenv(key)
    return monkeypatch


# ------------------------------------------------------------------------------------ parsing


def test_every_yaml_and_json_file_parses() -> None:
    yamls = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    jsons = sorted(DEPLOY.rglob("*.json"))
    names = {p.relative_to(DEPLOY).as_posix() for p in [*yamls, *jsons]}
    assert {
        "docker-compose.yml",
        "updater.yaml",
        "prometheus/prometheus.yml",
        "prometheus/alerts.yml",
        "grafana/rolloutpool.json",
        "grafana/provisioning/datasources/prometheus.yml",
        "grafana/provisioning/dashboards/rolloutpool.yml",
        "k8s/kustomization.yaml",
    } <= names
    for path in yamls:
        assert load_yaml(path), f"{path} has no document"
    for path in jsons:
        assert json.loads(path.read_text())
    # YAML embedded in Kubernetes ConfigMaps parses too
    for path in K8S.glob("*.yaml"):
        for doc in load_yaml(path):
            if doc.get("kind") == "ConfigMap":
                for key, text in doc["data"].items():
                    if key.endswith((".yml", ".yaml")):
                        assert isinstance(parse_yaml(text), dict), f"{path}:{key}"


# ------------------------------------------------------------------------------------ compose


def test_compose_has_every_service(compose: dict[str, Any]) -> None:
    assert {"redis", *REPLICAS, "router", "updater", "prometheus", "grafana"} <= set(
        compose["services"]
    )


def test_compose_redis_persists_with_aof(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = " ".join(redis["command"]) if isinstance(redis["command"], list) else redis["command"]
    assert "--appendonly yes" in command
    assert "--appendfsync everysec" in command
    assert "--requirepass" in command  # optional password, only when REDIS_PASSWORD is set
    assert any(m["target"] == "/data" for m in mounts(redis))


def test_compose_replicas(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gpus = []
    for name in REPLICAS:
        svc = services[name]
        assert "ports" not in svc, f"{name} must not publish its (control) port"
        assert svc["build"]["dockerfile"] == "Dockerfile.vllm"
        env = compose_env(svc)
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
        assert env["NCCL_NVLS_ENABLE"] == "0"
        cmd = svc["command"]
        assert cmd[:2] == ["vllm", "serve"]
        assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
        assert cmd[cmd.index("--served-model-name") + 1] == "rolloutpool"
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        assert cmd[cmd.index("--port") + 1] == "8000"
        assert "/health" in " ".join(svc["healthcheck"]["test"])
        (ckpt,) = [m for m in mounts(svc) if m["target"] == CHECKPOINTS]
        assert ckpt["read_only"] is True
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert len(device["device_ids"]) == 1, "one GPU per replica"
        gpus.append(env_default(device["device_ids"][0]))
    assert len(set(gpus)) == len(gpus), "replicas must default to different GPUs"


def test_compose_only_router_and_updater_publish(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            if name in ("router", "updater"):
                continue
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"
    assert compose["services"]["router"]["ports"]
    assert compose["services"]["updater"]["ports"]


def test_compose_router_and_updater(compose: dict[str, Any]) -> None:
    router, updater = compose["services"]["router"], compose["services"]["updater"]
    for svc in (router, updater):
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        env = compose_env(svc)
        assert env["ROLLOUTPOOL_REDIS_URL"] == "redis://redis:6379/0"
        assert "ROLLOUTPOOL_REDIS_PASSWORD" in env
    assert router["command"] == ["python", "-m", "router"]
    assert compose_env(router)["ROLLOUTPOOL_ROUTER_HOST"] == "0.0.0.0"
    assert updater["command"] == [
        "python",
        "-m",
        "updater",
        "--config",
        "/etc/rolloutpool/updater.yaml",
    ]
    assert "ROLLOUTPOOL_UPDATER_ADMIN_TOKEN" in compose_env(updater)
    targets = {m["target"]: m for m in mounts(updater)}
    assert targets["/etc/rolloutpool/updater.yaml"]["source"] == "./updater.yaml"
    assert CHECKPOINTS in targets
    # the updater starts only once both replicas answer /health
    assert {r: "service_healthy" for r in REPLICAS}.items() <= {
        k: v["condition"] for k, v in updater["depends_on"].items()
    }.items()


def test_dockerfiles() -> None:
    app = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\s*$", app, re.M)
    assert re.search(r"^RUN pip install \.", app, re.M)
    assert 'CMD ["python", "-m", "router"]' in app

    vllm = (DEPLOY / "Dockerfile.vllm").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:\$\{VLLM_TAG\}\s*$", vllm, re.M)
    (tag,) = re.findall(r"^ARG VLLM_TAG=(\S+)\s*$", vllm, re.M)
    assert in_supported_range(tag)
    assert "VLLM_SERVER_DEV_MODE=1" in vllm and "NCCL_NVLS_ENABLE=0" in vllm


def test_compose_vllm_tag_is_pinned(compose: dict[str, Any]) -> None:
    for name in REPLICAS:
        tag = env_default(compose["services"][name]["build"]["args"]["VLLM_TAG"])
        assert in_supported_range(tag)


# ------------------------------------------------------------------------------------ updater


def _updater_configs(k8s: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cm = k8s_obj(k8s, "ConfigMap", "updater-config")
    (doc,) = load_yaml(DEPLOY / "updater.yaml")
    return {"compose": doc, "k8s": parse_yaml(cm["data"]["updater.yaml"])}


def _no_file_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"settings construction opened a file: {args[:1]}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(io, "open", refuse)


@pytest.mark.parametrize("flavour", ["compose", "k8s"])
def test_updater_config_validates(
    flavour: str, k8s: list[dict[str, Any]], clean_env: pytest.MonkeyPatch
) -> None:
    data = _updater_configs(k8s)[flavour]
    assert set(data) == {"updater", "redis"}
    # secrets are not in the file: they come from the environment (the file would win over it)
    assert "admin_token" not in data["updater"]
    assert not {"password", "username"} & set(data["redis"])
    # both settings classes ignore unknown keys: a typo would be dropped silently, so check names
    up = data["updater"]
    assert set(up) <= set(UpdaterSettings.model_fields), set(up) - set(UpdaterSettings.model_fields)
    assert set(up.get("deadlines", {})) <= set(Deadlines.model_fields)
    for replica in up["replicas"]:
        assert set(replica) <= set(ReplicaConfig.model_fields), replica
    assert set(data["redis"]) <= set(StoreSettings.model_fields), data["redis"]

    with pytest.MonkeyPatch.context() as mp:
        _no_file_reads(mp)  # construction must not read the checkpoints (absent here)
        settings = UpdaterSettings(**data["updater"])
        store = StoreSettings(**data["redis"])

    assert settings.host == "0.0.0.0" and settings.port == 8300
    assert settings.admin_token is None  # nothing in the environment
    assert [r.id for r in settings.replicas] == list(REPLICAS)
    for r in settings.replicas:
        assert r.launch is None  # Compose / Kubernetes own the processes
        assert r.model.is_absolute() and r.model.as_posix().startswith(CHECKPOINTS + "/")
    assert store.namespace == "rp" and store.url == "redis://redis:6379/0"

    clean_env.setenv("ROLLOUTPOOL_UPDATER_ADMIN_TOKEN", "from-the-environment")
    clean_env.setenv("ROLLOUTPOOL_REDIS_PASSWORD", "redis-secret")
    settings = UpdaterSettings(**data["updater"])
    store = StoreSettings(**data["redis"])
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "from-the-environment"
    assert store.password is not None and store.password.get_secret_value() == "redis-secret"


def test_updater_config_matches_compose(compose: dict[str, Any], k8s: list[dict[str, Any]]) -> None:
    settings = UpdaterSettings(**_updater_configs(k8s)["compose"]["updater"])
    services = compose["services"]
    for r in settings.replicas:
        assert r.url == f"http://{r.id}:8000"
        assert r.id in services
        # the updater reads the manifest of the very checkpoint the replica serves
        cmd = services[r.id]["command"]
        assert env_default(cmd[cmd.index("serve") + 1]) == r.model.as_posix()


def test_updater_config_matches_k8s(k8s: list[dict[str, Any]]) -> None:
    settings = UpdaterSettings(**_updater_configs(k8s)["k8s"]["updater"])
    sts = k8s_obj(k8s, "StatefulSet", "replica")
    assert len(settings.replicas) == sts["spec"]["replicas"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    served = container["command"][container["command"].index("serve") + 1]
    svc = sts["spec"]["serviceName"]
    for i, r in enumerate(settings.replicas):
        assert r.id == f"{sts['metadata']['name']}-{i}"  # = the pod name
        assert r.url == f"http://{r.id}.{svc}.{NAMESPACE}.svc:8000"
        assert r.model.as_posix() == served


# ------------------------------------------------------------------------------------ k8s


def test_k8s_docs_are_well_formed(k8s: list[dict[str, Any]]) -> None:
    assert k8s
    for doc in k8s:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]
    kustomization = load_yaml(K8S / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_k8s_references_resolve(k8s: list[dict[str, Any]]) -> None:
    """Every Secret key, ConfigMap, PVC and ServiceAccount a workload refers to exists."""
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for d in k8s:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    secret_keys = {
        (name, key)
        for name, s in by_kind["Secret"].items()
        for key in {**s.get("data", {}), **s.get("stringData", {})}
    }
    for doc in k8s:
        for key, value in walk(doc):
            if key == "secretKeyRef":
                assert (value["name"], value["key"]) in secret_keys, value
            elif key == "configMap":
                assert value["name"] in by_kind["ConfigMap"], value
            elif key == "persistentVolumeClaim":
                assert value["claimName"] in by_kind["PersistentVolumeClaim"], value
            elif key == "serviceAccountName":
                assert value in by_kind["ServiceAccount"], value
    # placeholders are marked as such
    for s in by_kind["Secret"].values():
        assert all("CHANGE-ME" in v for v in s["stringData"].values())


def test_k8s_services_select_workloads(k8s: list[dict[str, Any]]) -> None:
    pod_labels = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in k8s
        if d["kind"] in ("Deployment", "StatefulSet")
    ]
    for svc in (d for d in k8s if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), svc["metadata"]


def test_k8s_vllm_statefulset(k8s: list[dict[str, Any]]) -> None:
    sts = k8s_obj(k8s, "StatefulSet", "replica")
    headless = k8s_obj(k8s, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert in_supported_range(c["image"].split(":", 1)[1])
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(c["resources"]["requests"]["nvidia.com/gpu"]) == "1"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" not in c  # the updater, not the kubelet, decides (see vllm.yaml)
    env = k8s_env(c)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    cmd = c["command"]
    assert cmd[:2] == ["vllm", "serve"]
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    (ckpt,) = [m for m in c["volumeMounts"] if m["mountPath"] == CHECKPOINTS]
    assert ckpt["readOnly"] is True


def test_k8s_router_and_updater(k8s: list[dict[str, Any]]) -> None:
    router = k8s_obj(k8s, "Deployment", "router")
    assert router["spec"]["replicas"] == 2
    updater = k8s_obj(k8s, "Deployment", "updater")
    assert updater["spec"]["replicas"] == 1
    assert updater["spec"]["strategy"]["type"] == "Recreate"
    (c,) = updater["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python", "-m", "updater", "--config", "/etc/rolloutpool/updater.yaml"]
    assert "ROLLOUTPOOL_UPDATER_ADMIN_TOKEN" in k8s_env(c)
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/rolloutpool", CHECKPOINTS}
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert k8s_env(rc)["ROLLOUTPOOL_REDIS_URL"] == "redis://redis:6379/0"  # updater: its config
    for container in (rc, c):
        assert "ROLLOUTPOOL_REDIS_PASSWORD" in k8s_env(container)
    k8s_obj(k8s, "Service", "router")
    k8s_obj(k8s, "Service", "updater")


def test_k8s_rbac_lets_the_updater_restart_the_replica_pods_only(
    k8s: list[dict[str, Any]], clean_env: pytest.MonkeyPatch
) -> None:
    """The kubernetes replica provider deletes a TAINTED replica's pod and reads it until the
    StatefulSet's successor is Ready: get + delete on those pods by name, nothing else; the
    updater (and only it among the pool's workloads without an RBAC role of their own) mounts a
    service account token. tests/unit/test_providers_kubernetes.py runs the provider against a
    fake API server that enforces this very Role."""
    role = k8s_obj(k8s, "Role", "updater-replica-pods")
    binding = k8s_obj(k8s, "RoleBinding", "updater-replica-pods")
    k8s_obj(k8s, "ServiceAccount", "updater")
    sts = k8s_obj(k8s, "StatefulSet", "replica")
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "resourceNames": pods,
            "verbs": ["get", "delete"],
        }
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "updater", "namespace": NAMESPACE}
    ]
    settings = UpdaterSettings(**_updater_configs(k8s)["k8s"]["updater"])
    assert settings.provider == "kubernetes"
    assert sorted(r.pod or r.id for r in settings.replicas) == pods
    updater = k8s_obj(k8s, "Deployment", "updater")["spec"]["template"]["spec"]
    assert updater["serviceAccountName"] == "updater"
    assert updater["automountServiceAccountToken"] is True
    for kind, name in [
        ("Deployment", "router"),
        ("StatefulSet", "replica"),
        ("StatefulSet", "redis"),
    ]:
        spec = k8s_obj(k8s, kind, name)["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, name


def test_k8s_redis_uses_aof(k8s: list[dict[str, Any]]) -> None:
    conf = k8s_obj(k8s, "ConfigMap", "redis-config")["data"]["redis.conf"]
    assert re.search(r"^appendonly yes$", conf, re.M)
    assert re.search(r"^appendfsync everysec$", conf, re.M)
    sts = k8s_obj(k8s, "StatefulSet", "redis")
    assert sts["spec"]["volumeClaimTemplates"]
    k8s_obj(k8s, "Service", "redis")


def _peers_and_ports(policy: dict[str, Any]) -> list[tuple[set[str], list[tuple[int, int]]]]:
    """Per ingress rule: the components (or ``label=value`` for other pods) it admits, and its
    port ranges. Every peer must be pinned to this namespace and every rule to ports."""
    rules = []
    for rule in policy["spec"]["ingress"]:
        peers: set[str] = set()
        for peer in rule["from"]:
            if "namespaceSelector" in peer:  # Never any namespace
                assert peer["namespaceSelector"] == {
                    "matchLabels": {"kubernetes.io/metadata.name": "rolloutpool"}
                }, peer
            sel = peer["podSelector"]
            labels = sel.get("matchLabels", {})
            comp = labels.get("app.kubernetes.io/component")
            if comp:
                peers.add(comp)
            for expr in sel.get("matchExpressions", []):
                assert expr["key"] == "app.kubernetes.io/component" and expr["operator"] == "In"
                peers |= set(expr["values"])
            peers |= {f"{k}={v}" for k, v in labels.items() if k.startswith("rolloutpool.io/")}
        assert rule.get("ports"), f"a rule without ports admits every port: {rule}"
        rules.append((peers, [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]))
    return rules


def test_k8s_vllm_network_policy(k8s: list[dict[str, Any]]) -> None:
    """Only the pool's components reach the replicas' port 8000 (API + dev-mode control routes);
    weight senders of this namespace reach NCCL's ephemeral ports only."""
    policy = k8s_obj(k8s, "NetworkPolicy", "vllm-ingress")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = _peers_and_ports(policy)
    to_api = set().union(
        *(peers for peers, ports in rules if any(a <= 8000 <= b for a, b in ports))
    )
    assert to_api == {"router", "updater", "prometheus"}
    sender = [ports for peers, ports in rules if "rolloutpool.io/weight-sender=true" in peers]
    assert sender == [[(32768, 60999)]]


def test_k8s_updater_network_policy(k8s: list[dict[str, Any]]) -> None:
    policy = k8s_obj(k8s, "NetworkPolicy", "updater-ingress")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "updater"
    rules = _peers_and_ports(policy)
    api = [peers for peers, ports in rules if (8300, 8300) in ports]
    assert api == [{"prometheus", "rolloutpool.io/updater-client=true"}]
    assert all(
        8300 not in range(a, b + 1) for peers, ports in rules if "vllm" in peers for a, b in ports
    )


# ------------------------------------------------------------------------------------ prometheus


def test_compose_prometheus_targets(compose: dict[str, Any]) -> None:
    (cfg,) = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in cfg["scrape_configs"]
    }
    assert targets["router"] == {"router:8000"}
    assert targets["updater"] == {"updater:8300"}
    assert targets["vllm"] == {f"{r}:8000" for r in REPLICAS}
    for t in set().union(*targets.values()):
        assert t.split(":")[0] in compose["services"]


def test_k8s_prometheus_discovers_every_component(k8s: list[dict[str, Any]]) -> None:
    cfg = parse_yaml(k8s_obj(k8s, "ConfigMap", "prometheus-config")["data"]["prometheus.yml"])
    components = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in k8s
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    jobs = {}
    for job in cfg["scrape_configs"]:
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod" and sd["namespaces"]["names"] == [NAMESPACE]
        (keep,) = [
            r
            for r in job["relabel_configs"]
            if r.get("action") == "keep" and r["source_labels"][-1].endswith("_component")
        ]
        name, component = keep["regex"].split(";")
        assert name == "rolloutpool" and component in components
        jobs[job["job_name"]] = component
    assert jobs == {"router": "router", "updater": "updater", "vllm": "vllm"}
    vllm_job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "vllm")
    assert any(r.get("target_label") == "replica" for r in vllm_job["relabel_configs"])


def _alert_rules(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def test_redis_alerts_are_loaded_everywhere(
    compose: dict[str, Any], k8s: list[dict[str, Any]]
) -> None:
    """Issue 11: Redis filled up with nobody told. Alert rules on its memory and reachability
    exist, are loaded by both Prometheus configs, and are the same rules in both."""
    (rules,) = load_yaml(DEPLOY / "prometheus" / "alerts.yml")
    (cfg,) = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]
    prom = compose["services"]["prometheus"]
    (mount,) = [m for m in mounts(prom) if m["target"] == "/etc/prometheus/alerts.yml"]
    assert mount["source"] == "./prometheus/alerts.yml" and mount["read_only"] is True

    cm = k8s_obj(k8s, "ConfigMap", "prometheus-config")["data"]
    assert parse_yaml(cm["prometheus.yml"])["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert parse_yaml(cm["alerts.yml"]) == rules
    (container,) = k8s_obj(k8s, "Deployment", "prometheus")["spec"]["template"]["spec"][
        "containers"
    ]
    assert {"mountPath": "/etc/prometheus", "name": "config", "readOnly": True} in container[
        "volumeMounts"
    ]

    alerts = _alert_rules(rules)
    memory, down = alerts["RolloutPoolRedisMemoryHigh"], alerts["RolloutPoolRedisUnreachable"]
    assert promql_metric_names(memory["expr"]) == {
        "rolloutpool_redis_used_memory_bytes",
        "rolloutpool_redis_maxmemory_bytes",
    }
    assert memory["expr"].rstrip().endswith("> 0.8") and memory["for"] == "5m"
    assert "> 0)" in memory["expr"]  # a Redis without maxmemory (0) must not divide by zero
    assert promql_metric_names(down["expr"]) == {"rolloutpool_redis_up"}
    known = exposed_metric_names()
    for name, rule in alerts.items():
        assert promql_metric_names(rule["expr"]) <= known, name
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# ------------------------------------------------------------------------------------ grafana


def test_promql_metric_names_extraction() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, route) (rate(rolloutpool_request_seconds_bucket"
        '{route!~"x|y"}[$__rate_interval]))) / ignoring(a) group_left(b) vllm:kv_cache_usage_perc'
        " offset 5m > 1e3 or vector(0)"
    )
    assert promql_metric_names(expr) == {
        "rolloutpool_request_seconds_bucket",
        "vllm:kv_cache_usage_perc",
    }


def test_dashboard_uses_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    known = exposed_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = {n for n in names if n not in known and n not in VLLM_METRICS}
        assert not unknown, f"{expr!r} refers to metrics nobody exports: {unknown}"
        used |= names
    # the panels the dashboard promises
    assert {
        "rolloutpool_published_generation",
        "rolloutpool_replica_generation",
        "rolloutpool_replica_state",
        "rolloutpool_active_bindings",
        "rolloutpool_admissions_total",
        "rolloutpool_admission_refusals_total",
        "rolloutpool_request_seconds_bucket",
        "rolloutpool_update_phase_seconds_bucket",
        "rolloutpool_taints_total",
        "rolloutpool_recoveries_total",
        "rolloutpool_violations_total",
        "rolloutpool_redis_used_memory_bytes",
        "rolloutpool_redis_maxmemory_bytes",
        "rolloutpool_redis_up",
    } <= used


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] == "rolloutpool" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (ds,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": source["uid"]}


def test_grafana_provisioning_matches_compose(compose: dict[str, Any]) -> None:
    (prov,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "rolloutpool.yml")
    (provider,) = prov["providers"]
    targets = {m["target"]: m["source"] for m in mounts(compose["services"]["grafana"])}
    assert targets["/etc/grafana/provisioning"] == "./grafana/provisioning"
    dash = provider["options"]["path"] + "/rolloutpool.json"
    assert targets[dash] == "./grafana/rolloutpool.json"


# ------------------------------------------------------------------------------------ ray


def test_ray_job_config_validates_and_places_gpu_replicas_as_actors(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """deploy/ray/pool.yaml is what deploy/ray/pool_job.py reads: the updater's, Redis' and the
    router's settings, the replicas as Ray actors that each reserve a GPU and run vLLM's GPU
    flavour with the NCCL weight-transfer backend."""
    (doc,) = load_yaml(DEPLOY / "ray" / "pool.yaml")
    settings = UpdaterSettings(**doc["updater"])
    StoreSettings(**doc["redis"])
    router = RouterSettings(**doc["router"])
    assert settings.provider == "ray" and settings.ray.address is None  # the job's own cluster
    assert settings.ray.detached and settings.ray.placement.num_gpus == 1
    for r in settings.replicas:
        assert r.launch is not None and r.launch.flavor == "gpu"
        assert r.launch.weight_transfer_backend == "nccl"
        assert (r.ray or settings.ray.placement).num_gpus >= 1
        assert r.launch.model == r.model
    assert router.max_staleness == settings.max_staleness
    compile((DEPLOY / "ray" / "pool_job.py").read_text(), "pool_job.py", "exec")


# ------------------------------------------------------------------------------------ sentinel


SENTINEL_ENV = {
    "ROLLOUTPOOL_REDIS_SENTINELS",
    "ROLLOUTPOOL_REDIS_SENTINEL_SERVICE",
    "ROLLOUTPOOL_REDIS_WAIT_REPLICAS",
}


def _sentinel_conf(text: str) -> dict[str, str]:
    """``sentinel <directive> <service> <value>`` lines of a generated sentinel config."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "sentinel" and parts[2] == "rolloutpool":
            out[parts[1]] = " ".join(parts[3:])
    return out


def _store_of(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> StoreSettings:
    for k, v in env.items():
        if k.startswith("ROLLOUTPOOL_REDIS_") and "${" not in v:
            monkeypatch.setenv(k, v)
    return StoreSettings()


def test_compose_sentinel_variant(compose: dict[str, Any], clean_env: pytest.MonkeyPatch) -> None:
    """docker-compose.sentinel.yml: a primary, two replicas and three sentinels (quorum 2);
    the router and the updater reach Redis through the sentinels and wait for one replica; an
    old primary stops taking writes (min-replicas-max-lag) before the sentinels give up on it
    (down-after), so it never accepts writes that count."""
    (doc,) = load_yaml(DEPLOY / "docker-compose.sentinel.yml")
    services = doc["services"]
    nodes = ["redis", "redis-replica-1", "redis-replica-2"]
    sentinels = ["sentinel-1", "sentinel-2", "sentinel-3"]
    assert set(nodes + sentinels) <= set(services)
    assert set(services) <= set(compose["services"]) | set(nodes + sentinels)
    for name in nodes:
        cmd = " ".join(services[name]["command"])
        assert "--appendonly" in cmd and "--min-replicas-to-write" in cmd
        lag = int(cmd.split("--min-replicas-max-lag")[1].split()[0].strip('"'))
        if name != "redis":
            assert "--replicaof redis 6379" in cmd
    for name in sentinels:
        conf = _sentinel_conf(services[name]["command"][-1])
        assert conf["monitor"].split() == ["redis", "6379", "2"]  # quorum: a majority of 3
        assert int(conf["down-after-milliseconds"]) > lag * 1000
    for name in ("router", "updater"):
        env = compose_env(services[name])
        assert SENTINEL_ENV <= set(env)
        store = _store_of(env, clean_env)
        assert store.mode == "sentinel" and store.wait_replicas == 1
        assert [a.split(":")[0] for a in store.sentinels] == sentinels
        assert store.sentinel_service == "rolloutpool"


def test_k8s_sentinel_variant(clean_env: pytest.MonkeyPatch) -> None:
    """deploy/k8s/sentinel: the base minus its single Redis, plus three Redis nodes and three
    sentinels; router and updater patched onto the sentinels."""
    root = K8S / "sentinel"
    (kust,) = load_yaml(root / "kustomization.yaml")
    assert kust["resources"] == ["..", "redis-sentinel.yaml"]
    deleted = [parse_yaml(p["patch"]) for p in kust["patches"] if "patch" in p]
    assert {(d["kind"], d["metadata"]["name"]) for d in deleted} == {
        ("StatefulSet", "redis"),
        ("Service", "redis"),
    }
    assert all(d["$patch"] == "delete" for d in deleted)
    docs = load_yaml(root / "redis-sentinel.yaml")
    nodes = k8s_obj(docs, "StatefulSet", "redis-node")
    sentinel = k8s_obj(docs, "StatefulSet", "redis-sentinel")
    assert nodes["spec"]["replicas"] == 3 and sentinel["spec"]["replicas"] == 3
    config = k8s_obj(docs, "ConfigMap", "redis-ha")["data"]
    assert "appendonly yes" in config["redis.conf"]
    lag = int(config["redis.conf"].split("min-replicas-max-lag")[1].split()[0])
    conf = _sentinel_conf(config["start-sentinel.sh"])
    assert conf["monitor"].split()[-1] == "2"
    assert int(conf["down-after-milliseconds"]) > lag * 1000
    assert "GET-MASTER-ADDR-BY-NAME rolloutpool" in config["start-node.sh"]
    for svc in ("redis-node", "redis-sentinel"):
        assert k8s_obj(docs, "Service", svc)["spec"]["clusterIP"] == "None"
    patches = load_yaml(root / "clients.yaml")
    for name in ("router", "updater"):
        (container,) = k8s_obj(patches, "Deployment", name)["spec"]["template"]["spec"][
            "containers"
        ]
        env = {k: str(v) for k, v in k8s_env(container).items()}
        assert SENTINEL_ENV <= set(env)
        store = _store_of(env, clean_env)
        assert store.mode == "sentinel" and store.wait_replicas == 1
        assert [a.split(".")[0] for a in store.sentinels] == [
            f"redis-sentinel-{i}" for i in range(3)
        ]
