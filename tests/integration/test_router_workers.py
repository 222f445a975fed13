"""``python -m router --workers 2``: two processes serve one port, and they live and die with
their parent. Real router processes on a real redis-server; no vLLM (seconds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pool.launcher import free_port
from pool.settings import StoreSettings

pytestmark = pytest.mark.integration

START_S = 60.0


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def router(
    store_settings: StoreSettings, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    env = {
        **os.environ,
        "ROLLOUTPOOL_ROUTER_PORT": str(port),
        "ROLLOUTPOOL_REDIS_URL": store_settings.url,
        "ROLLOUTPOOL_REDIS_NAMESPACE": store_settings.namespace,
    }
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--workers", "2"], env=env, stdout=log, stderr=log
    )
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def worker_pids(url: str) -> set[int]:
    """The pids that answer ``/healthz`` on ``url``, one new connection per request, until both
    workers answered (the kernel hashes each new connection to one of them)."""
    pids: set[int] = set()
    deadline = time.monotonic() + START_S
    while len(pids) < 2 and time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/healthz", timeout=5)  # a fresh connection each time
        except httpx.TransportError:
            time.sleep(0.1)  # not listening yet
            continue
        if r.status_code == 200:
            body = r.json()
            assert body["worker"]["of"] == 2 and body["worker"]["index"] in (0, 1)
            pids.add(body["worker"]["pid"])
        else:
            time.sleep(0.1)
    return pids


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_two_workers_share_the_port_and_stop_with_the_parent(
    router: tuple[subprocess.Popen[bytes], str], stop: signal.Signals
) -> None:
    """Both worker processes answer on the one port, neither is the parent, and stopping the
    parent (SIGTERM: forwarded; SIGKILL: the workers' parent-death signal) leaves no orphan."""
    proc, url = router
    pids = worker_pids(url)
    assert len(pids) == 2 and proc.pid not in pids, pids
    proc.send_signal(stop)
    proc.wait(timeout=30)
    wait_until(lambda: not any(alive(p) for p in pids), 30, f"workers {pids} to exit")
    if stop == signal.SIGTERM:
        assert proc.returncode == 0
