"""A Ray cluster of several nodes on this machine, for the Ray provider's tests and benchmark.

Each node is one ``ray start`` (the head, then ``--address`` for the others) on ``127.0.0.2``
(:data:`NODE_IP`), with its own CPUs, custom resources, node labels and environment (e.g.
``ROLLOUTPOOL_CPU_BIND``, so a CPU replica placed there pins that node's core). The machine is
small (2 cores, 24 GiB): the dashboard is off, each node's object store is 100 MiB, and the GCS
declares a node dead after about 3 s without heartbeats (``RAY_health_check_*``), so a lost node
is noticed quickly. Token authentication (on by default for clusters ``ray start`` makes) is
off: the cluster is reachable only on the loopback interface.

Every process a node starts (raylet, workers, actors, and the vLLM servers the actors start)
inherits the marker ``ROLLOUTPOOL_TEST_RAY_NODE=<name>``: :meth:`RayCluster.kill_node` SIGKILLs
exactly those, which is what a machine that vanished looks like to the rest of the cluster.
:meth:`RayCluster.stop` kills every node's processes, then runs ``ray stop --force``. Callers hold
``/work/heavy.lock`` (or CI's equivalent: nothing else heavy runs) and stop the cluster in a
``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit.redis_server import free_port

__all__ = ["MARKER", "NODE_IP", "RayCluster", "RayNode", "ray_bin"]

MARKER = "ROLLOUTPOOL_TEST_RAY_NODE"
#: A loopback address Ray does not rewrite: given "127.0.0.1" or "localhost", Ray connects to the
#: machine's outward address instead (``resolve_ip_for_localhost``); all of 127/8 is loopback.
NODE_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 100 * 1024 * 1024
#: Node death after ~3 missed 1 s heartbeats (Ray's defaults take ~30 s).
FAST_HEALTH = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def ray_bin() -> Path:
    """The ``ray`` CLI of this Python environment (installed with the ``ray`` extra)."""
    path = Path(sys.executable).parent / "ray"
    if not path.exists():
        raise FileNotFoundError(f"{path}: install the ray extra (pip install -e '.[ray]')")
    return path


@dataclass
class RayNode:
    name: str
    num_cpus: int
    resources: dict[str, float]
    labels: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)


class RayCluster:
    """See the module docstring. Not thread-safe."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.nodes: dict[str, RayNode] = {}

    @property
    def address(self) -> str:
        """The GCS address, for ``ray.init(address=...)`` and ``ray start --address``."""
        return f"{NODE_IP}:{self.port}"

    def _env(self, node: RayNode) -> dict[str, str]:
        env = dict(os.environ)
        env.update(FAST_HEALTH)
        env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})
        env.update({MARKER: node.name, **node.env})
        return env

    def _start(self, node: RayNode, head: bool) -> None:
        argv = [str(ray_bin()), "start", "--node-ip-address", NODE_IP]
        argv += ["--num-cpus", str(node.num_cpus), "--resources", json.dumps(node.resources)]
        argv += ["--labels", ",".join(f"{k}={v}" for k, v in node.labels.items())]
        argv += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
        argv += ["--dashboard-agent-listen-port", str(free_port())]
        if head:
            argv += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            argv += ["--ray-client-server-port", str(free_port())]
        else:
            argv += ["--address", self.address]
        log = self.workdir / f"ray-start-{node.name}.log"
        t0 = time.monotonic()
        with log.open("ab") as out:
            proc = subprocess.run(
                argv, env=self._env(node), stdout=out, stderr=subprocess.STDOUT, timeout=180
            )
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ray start ({node.name}) exited {proc.returncode}:\n{tail}")
        self.nodes[node.name] = node
        print(f"ray node {node.name} up in {time.monotonic() - t0:.1f}s", flush=True)

    def start_head(self, node: RayNode) -> None:
        self._start(node, head=True)

    def add_node(self, node: RayNode) -> None:
        self._start(node, head=False)

    def pids(self, name: str) -> list[int]:
        """The live processes that carry node ``name``'s marker."""
        want = f"{MARKER}={name}".encode()
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if want in env:
                found.append(int(entry.name))
        return found

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of node ``name`` at once (the machine vanished); returns them."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes.pop(name, None)
        return pids

    def stop(self) -> None:
        """Kill every node's processes, then ``ray stop --force``. Idempotent."""
        for name in list(self.nodes):
            self.kill_node(name)
        subprocess.run(
            [str(ray_bin()), "stop", "--force"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )
