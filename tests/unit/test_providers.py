"""``updater.providers``: the registry, which provider a pool's settings pick, and what each
built-in provider needs of a replica. The adapters themselves are exercised for real elsewhere
(local: every integration test; Ray: tests/integration/test_ray_provider.py; Kubernetes:
tests/unit/test_providers_kubernetes.py against a fake API server)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from pool.launcher import ReplicaSpec
from updater.providers import registry
from updater.providers.external import ExternalProvider
from updater.providers.leash import attach, start_ticks
from updater.providers.local import LocalProvider
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
        started = start_ticks(child.pid)
        assert started is not None and started >= start_ticks(os.getpid())  # type: ignore[operator]
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None  # reaped: gone


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if start_ticks(pid) is None or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_leash_kills_the_whole_group_once_its_owner_dies() -> None:
    """Found in the Ray provider's test: when Ray killed a replica's actor, it killed the actor's
    direct child (the vLLM API server) but left its EngineCore and worker running with no owner.
    A detached leash SIGKILLs the server's whole process group once the owner is gone."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # a group like vLLM's: a leader and a grandchild; the leader dies first, as Ray kills it
    group = subprocess.Popen(
        [sys.executable, "-c", GROUP], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert group.stdout is not None
    grandchild = int(group.stdout.readline())
    leash = attach(group.pid, owner=owner.pid, every_s=0.05)
    try:
        assert os.getppid() != leash.pid and start_ticks(leash.pid) is not None
        group.kill()  # the direct child goes first; the grandchild stays (as EngineCore did)
        group.wait()
        assert not _gone(grandchild, 0.3)
        owner.kill()
        owner.wait()
        assert _gone(grandchild, 5.0)  # the leash saw its owner go and killed the group
        assert _gone(leash.pid, 5.0)  # and then ended itself
    finally:
        for p in (owner, group):
            p.kill()
            p.wait()
        leash.cut()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)


GROUP = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_replicas_of_one_host_claim_distinct_core_sets(tmp_path: Path) -> None:
    """Found in the Ray provider's test: a replica moved to a node that already ran one was bound
    to the same core and its start made no progress (vLLM's CPU worker spins on its cores). Each
    actor claims a free core set of its node; a set is freed when its holder dies."""
    ray_actor = pytest.importorskip("updater.providers.ray_actor")
    claim = (
        "import sys, time; from updater.providers.ray_actor import claim_cores; "
        "print(claim_cores(sys.argv[1])[0], flush=True); time.sleep(60)"
    )
    choices = f"{tmp_path.name}-a;{tmp_path.name}-b"  # names only: no core is bound here
    first = subprocess.Popen([sys.executable, "-c", claim, choices], stdout=subprocess.PIPE)
    try:
        assert first.stdout is not None and first.stdout.readline().decode().strip().endswith("-a")
        cores, fd = ray_actor.claim_cores(choices)
        assert cores.endswith("-b") and fd is not None
        assert ray_actor.claim_cores(choices) == (f"{tmp_path.name}-a", None)  # all held: share
        os.close(fd)
    finally:
        first.kill()
        first.wait()
    cores, fd = ray_actor.claim_cores(choices)  # the dead holder's set is free again
    assert cores.endswith("-a") and fd is not None
    os.close(fd)


def test_rolloutpool_up_takes_a_launching_provider() -> None:
    from rolloutpool.errors import CliError
    from rolloutpool.up import pool_config

    config = pool_config(None, {"provider": "ray"}, "head:6379")
    assert (config.provider, config.ray.address) == ("ray", "head:6379")
    with pytest.raises(CliError, match="python -m updater --config"):
        pool_config(None, {"provider": "kubernetes"})  # its replicas are not started by `up`


async def test_local_provider_restarts_a_fresh_process_at_the_same_url(tmp_path: Path) -> None:
    """The local provider end to end (a stand-in server, as in test_launcher_deadline: the real
    launcher, process group, /health and completion probe): start, a process known gone, a
    restart that is a new process (new incarnation) at the same URL, stop."""
    from tests.unit.test_launcher_deadline import SLOW, _spec

    spec = _spec(
        tmp_path, SLOW.format(spin=0.0), startup_timeout_s=30.0, startup_max_s=60.0
    ).model_copy(update={"stop_grace_s": 1.0})
    cfg = ReplicaConfig(id="a", model=MODEL, launch=spec)
    p = LocalProvider.from_settings(UpdaterSettings(replicas=[cfg]))
    try:
        first = await p.start("a")
        assert first.url == p.url("a") and first.node_address == "127.0.0.1"
        before = await p.incarnation("a")
        assert before is not None and before.startswith("pid:") and await p.alive("a")
        p.launcher("a").kill(signal.SIGKILL)
        p.launcher("a")._proc.wait()  # type: ignore[union-attr]
        assert await p.alive("a") is False  # known gone: no health check needed
        again = await p.restart_fresh("a")
        assert again.url == first.url and await p.alive("a")
        assert await p.incarnation("a") not in (None, before)
    finally:
        await p.stop("a")
    assert await p.alive("a") is False


def test_a_ray_placement_names_one_way_to_choose_its_node() -> None:
    from updater.providers.config import RayPlacement

    with pytest.raises(ValidationError, match="placement group decides the node"):
        RayPlacement(placement_group="pg", prefer_node_labels={"zone": "a"})
    with pytest.raises(ValidationError, match="not both"):
        RayPlacement(prefer_node_labels={"zone": "a"}, label_selector={"zone": "b"})
    assert RayPlacement(num_gpus=1, resources={"rp_replica": 1}).num_cpus == 1.0
