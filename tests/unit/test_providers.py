"""``updater.providers``: the registry, which provider a pool's settings pick, and what each
built-in provider needs of a replica. The adapters themselves are exercised for real elsewhere
(local: every integration test; Ray: tests/integration/test_ray_provider.py; Kubernetes:
tests/unit/test_providers_kubernetes.py against a fake API server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pool.launcher import ReplicaSpec
from updater.providers import registry
from updater.providers.external import ExternalProvider
from updater.providers.local import LocalProvider, process_start_ticks
from updater.settings import ReplicaConfig, UpdaterSettings

MODEL = Path("/models/m")


def launched(rid: str) -> ReplicaConfig:
    return ReplicaConfig(id=rid, model=MODEL, launch=ReplicaSpec(model=MODEL, name=rid))


def by_url(rid: str) -> ReplicaConfig:
    return ReplicaConfig(id=rid, model=MODEL, url=f"http://{rid}.test:8000")


def test_built_in_providers_are_registered_and_imported_lazily() -> None:
    assert registry.names() == ["external", "kubernetes", "local", "ray"]
    with pytest.raises(ValueError, match="unknown replica provider 'slurm'; registered: ext"):
        registry.require("slurm")
    # naming a provider imports nothing: ray and the Kubernetes client are optional extras
    code = (
        "import sys; from updater.settings import UpdaterSettings; "
        "UpdaterSettings(provider='ray'); UpdaterSettings(provider='kubernetes'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'kubernetes')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "[]"


def test_auto_picks_local_or_external_and_refuses_a_mixed_pool() -> None:
    assert UpdaterSettings(replicas=[launched("a"), launched("b")]).provider == "local"
    assert UpdaterSettings(replicas=[by_url("a")]).provider == "external"
    with pytest.raises(ValidationError, match="some replicas have a launch spec"):
        UpdaterSettings(replicas=[launched("a"), by_url("b")])
    with pytest.raises(ValidationError, match="unknown replica provider 'slurm'"):
        UpdaterSettings(provider="slurm", replicas=[by_url("a")])


@pytest.mark.parametrize(
    ("provider", "replica", "error"),
    [
        ("local", by_url("a"), r"provider local needs \['launch'\]"),
        ("external", launched("a"), r"provider external needs \['url'\]"),
        ("ray", by_url("a"), r"provider ray needs \['launch'\]"),
        (
            "ray",
            launched("a").model_copy(update={"url": "http://a:1"}),
            r"provider ray does not use \['url'\]",  # placement decides where it serves
        ),
        ("kubernetes", launched("a"), r"provider kubernetes does not use \['launch'\]"),
    ],
)
def test_each_provider_says_what_a_replica_lacks_or_has_no_use_for(
    provider: str, replica: ReplicaConfig, error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        UpdaterSettings(provider=provider, replicas=[replica.model_dump()])


def test_kubernetes_replicas_need_no_url_and_name_their_pod() -> None:
    s = UpdaterSettings(
        provider="kubernetes",
        replicas=[{"id": "replica-0", "model": MODEL}, {"id": "r1", "model": MODEL, "pod": "p-1"}],
    )
    assert [r.pod for r in s.replicas] == [None, "p-1"]
    with pytest.raises(ValidationError):
        UpdaterSettings(provider="kubernetes", replicas=[{"id": "a", "model": MODEL, "pod": "A_"}])


async def test_external_provider_cannot_restart_and_knows_no_process() -> None:
    p = ExternalProvider.from_settings(UpdaterSettings(replicas=[by_url("a")]))
    assert (p.launches, p.can_restart) == (False, False)
    loc = await p.start("a")
    assert (loc.url, loc.node_address) == ("http://a.test:8000", "a.test")
    assert await p.incarnation("a") is None and await p.alive("a") is None
    with pytest.raises(Exception, match="restart it through its orchestrator"):
        await p.restart_fresh("a")


def test_local_incarnation_is_the_pid_with_its_start_time() -> None:
    """A pid alone could be recycled by a later process; with its start time it cannot."""
    p = LocalProvider.from_settings(UpdaterSettings(replicas=[launched("a")]))
    assert p.url("a").startswith("http://127.0.0.1:")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_start_ticks(child.pid)
        assert started is not None and started >= process_start_ticks(os.getpid())  # type: ignore[operator]
    finally:
        child.kill()
        child.wait()
    assert process_start_ticks(child.pid) is None  # reaped: gone
