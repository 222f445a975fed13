"""Redis that fails over, as real local processes (tests and benchmarks).

* :class:`SentinelGroup` — one primary, N replicas and M ``redis-sentinel`` processes (Debian's
  ``redis-sentinel``; ``redis-server --sentinel`` where that is missing) monitoring them under
  one service name, with short failure-detection times for tests. Every data node runs with
  AOF and ``min-replicas-to-write`` (a primary cut off from its replicas stops accepting
  writes after ``min_replicas_max_lag_s``), so an old primary that comes back after a failover
  refuses the pool's writes until the sentinels turn it into a replica.
* :class:`ClusterGroup` — a Redis Cluster of N primaries (``redis-server --cluster-enabled
  yes`` + ``redis-cli --cluster create``).

Every process runs in its own process group on 127.0.0.1 and is stopped by ``stop()``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pool.errors import RolloutPoolError
from pool.launcher import free_port
from pool.settings import StoreSettings
from testkit.redis_server import RedisServer

__all__ = ["ClusterGroup", "SentinelGroup", "command"]


def command(port: int, *args: str, timeout_s: float = 2.0) -> str:
    """One command on ``127.0.0.1:port`` through ``redis-cli`` (raw output; '' if it failed)."""
    try:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), "--raw", *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout.strip()


def _info(port: int, section: str) -> dict[str, str]:
    text = command(port, "INFO", section)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def _wait(what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise RolloutPoolError(f"timed out after {timeout_s:g} s waiting for {what}")


class Sentinel:
    """One ``redis-sentinel`` process."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, conf: str) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "sentinel.conf"  # sentinels rewrite their config: a private copy
        path.write_text(conf)
        exe = shutil.which("redis-sentinel")
        argv = [exe, str(path)] if exe else ["redis-server", str(path), "--sentinel"]
        self.proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority).

    ``nodes[i]`` keeps its port for good; which of them is the primary changes with every
    failover (:meth:`primary_port` asks the sentinels). A killed node is brought back with
    :meth:`restart`, as a replica of the current primary.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        service: str = "rolloutpool",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        min_replicas_max_lag_s: int = 3,
        min_replicas_to_write: int = 1,
    ) -> None:
        self.workdir = workdir
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.lag_s = min_replicas_max_lag_s
        self.min_replicas = min_replicas_to_write
        self.nodes = [
            RedisServer(workdir / f"node-{i}", port=free_port()) for i in range(1 + replicas)
        ]
        self.sentinels = [
            Sentinel(workdir / f"sentinel-{i}", free_port()) for i in range(sentinels)
        ]

    # ------------------------------------------------------------------ lifecycle

    def _node_args(self, primary_port: int | None) -> list[str]:
        args = ["--min-replicas-to-write", str(self.min_replicas)]
        args += ["--min-replicas-max-lag", str(self.lag_s)]
        args += ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        if primary_port is not None:
            args += ["--replicaof", "127.0.0.1", str(primary_port)]
        return args

    def start(self, timeout_s: float = 30.0) -> SentinelGroup:
        primary = self.nodes[0]
        # the first writes need a replica in sync (min-replicas-to-write): replicas first
        primary.extra = self._node_args(None)
        primary.start()
        for node in self.nodes[1:]:
            node.extra = self._node_args(primary.port)
            node.start()
        self.wait_replicas_synced(primary.port, len(self.nodes) - 1, timeout_s)
        quorum = len(self.sentinels) // 2 + 1
        for s in self.sentinels:
            s.start(
                "\n".join(
                    [
                        f"port {s.port}",
                        "bind 127.0.0.1",
                        "daemonize no",
                        f"dir {s.workdir}",
                        f"logfile {s.workdir / 'sentinel.log'}",
                        f"sentinel monitor {self.service} 127.0.0.1 {primary.port} {quorum}",
                        f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                        f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                        f"sentinel parallel-syncs {self.service} 1",
                        "",
                    ]
                )
            )
        self.wait_sentinels_ready(timeout_s)
        return self

    def _sentinel_sees_all(self, port: int) -> bool:
        """The sentinel knows every other sentinel and has fresh INFO of every replica with its
        link to the primary up (else it finds no replica to promote: NOGOODSLAVE)."""
        lines = command(port, "SENTINEL", "MASTER", self.service).splitlines()
        state = dict(zip(lines[::2], lines[1::2], strict=False))
        if state.get("num-other-sentinels") != str(len(self.sentinels) - 1):
            return False
        lines = command(port, "SENTINEL", "REPLICAS", self.service).splitlines()
        pairs = list(zip(lines[::2], lines[1::2], strict=False))
        good = sum(1 for k, v in pairs if k == "master-link-status" and v == "ok")
        fresh = sum(1 for k, v in pairs if k == "info-refresh" and v.isdigit() and int(v) < 5000)
        flags = [v for k, v in pairs if k == "flags"]
        return (
            good == fresh == len(self.nodes) - 1
            and len(flags) == len(self.nodes) - 1
            and all(f == "slave" for f in flags)
        )

    def wait_sentinels_ready(self, timeout_s: float = 30.0) -> None:
        """Until every sentinel could promote any replica (see :meth:`_sentinel_sees_all`)."""
        for s in self.sentinels:
            _wait(
                f"sentinel {s.port} to see the group",
                lambda s=s: self._sentinel_sees_all(s.port),
                timeout_s,
            )

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for node in self.nodes:
            node.stop(timeout_s=2.0)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ views

    @property
    def sentinel_addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def store_settings(self, namespace: str, **kw: Any) -> StoreSettings:
        """Settings of a store on this group (``wait_replicas`` = 1 unless given)."""
        kw.setdefault("wait_replicas", 1)
        return StoreSettings(
            sentinels=self.sentinel_addresses,
            sentinel_service=self.service,
            namespace=namespace,
            **kw,
        )

    def epochs(self) -> list[int]:
        """Every reachable sentinel's config-epoch for the service."""
        out = []
        for s in self.sentinels:
            lines = command(s.port, "SENTINEL", "MASTER", self.service).splitlines()
            state = dict(zip(lines[::2], lines[1::2], strict=False))
            if "config-epoch" in state:
                out.append(int(state["config-epoch"]))
        return out

    def primary_port(self) -> int:
        """The primary's port according to a majority of the sentinels."""
        votes: dict[int, int] = {}
        for s in self.sentinels:
            lines = command(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            parts = lines.splitlines()
            if len(parts) == 2 and parts[1].isdigit():
                votes[int(parts[1])] = votes.get(int(parts[1]), 0) + 1
        if not votes:
            raise RolloutPoolError("no sentinel answered")
        port, n = max(votes.items(), key=lambda kv: kv[1])
        if n <= len(self.sentinels) // 2:
            raise RolloutPoolError(f"the sentinels disagree about the primary: {votes}")
        return port

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def role(self, port: int) -> str:
        return _info(port, "replication").get("role", "")

    # ------------------------------------------------------------------ failovers

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> tuple[int, float]:
        """Wait until every sentinel names a primary other than ``old_port`` and it answers as
        a primary. Returns its port and the monotonic time that was first seen."""

        def promoted() -> int | None:
            try:
                port = self.primary_port()
            except RolloutPoolError:
                return None
            return port if port != old_port and self.role(port) == "master" else None

        port = _wait(f"a primary other than {old_port}", promoted, timeout_s)
        return int(port), time.monotonic()

    def wait_replicas_synced(
        self, primary_port: int | None, n: int, timeout_s: float = 60.0
    ) -> None:
        """Until ``n`` replicas are online at ``primary_port`` (None: whichever node the
        sentinels name as the primary at each check)."""

        def synced() -> bool:
            try:
                port = primary_port if primary_port is not None else self.primary_port()
            except RolloutPoolError:
                return False
            info = _info(port, "replication")
            return (
                sum(1 for k, v in info.items() if k.startswith("slave") and "state=online" in v)
                >= n
            )

        _wait(f"{n} replicas in sync with {primary_port or 'the primary'}", synced, timeout_s)

    def wait_caught_up(self, primary_port: int, timeout_s: float = 10.0) -> None:
        """Until every replica has acknowledged the primary's whole replication stream."""

        def caught_up() -> bool:
            info = _info(primary_port, "replication")
            offset = info.get("master_repl_offset")
            slaves = [v for k, v in info.items() if k.startswith("slave") and "offset=" in v]
            return bool(slaves) and all(f"offset={offset}," in v for v in slaves)

        _wait(f"the replicas of {primary_port} to catch up", caught_up, timeout_s)

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """(Re)start a node as what the sentinels take it for: a replica of the current
        primary, or the primary itself where they have not failed over from it (a node
        started with its old ``--replicaof`` would follow a node that is a replica now)."""
        node = self.node(port)
        node.stop(timeout_s=1.0)
        primary = self.primary_port()
        node.extra = self._node_args(None if primary == port else primary)
        node.start(timeout_s)

    def force_failover(self) -> None:
        """``SENTINEL FAILOVER``: promote a replica now, as if the primary were unreachable."""
        out = command(self.sentinels[0].port, "SENTINEL", "FAILOVER", self.service)
        if out != "OK":
            raise RolloutPoolError(f"SENTINEL FAILOVER refused: {out}")

    def reachable(self, port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False


class ClusterGroup:
    """A Redis Cluster of ``primaries`` primaries (no replicas) on 127.0.0.1."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.nodes = [
            RedisServer(
                workdir / f"node-{i}",
                port=free_port(),
                appendonly=False,
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",  # the bus port (default: port + 10000, often > 65535)
                    str(free_port()),
                ],
            )
            for i in range(primaries)
        ]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout_s: float = 30.0) -> ClusterGroup:
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *addrs,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            self.stop()
            raise RolloutPoolError(f"redis-cli --cluster create failed: {out.stdout[-500:]}")
        for node in self.nodes:
            _wait(
                f"cluster state ok on {node.port}",
                lambda node=node: "cluster_state:ok" in command(node.port, "CLUSTER", "INFO"),
                timeout_s,
            )
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(timeout_s=2.0)

    def __enter__(self) -> ClusterGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
