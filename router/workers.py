"""Serving the router from several processes on one port (``python -m router --workers N``).

Each worker is a whole router (its own app, Redis client, upstream pool, reaper, lease renewer
and failover guard), listening on the same ``host:port`` with ``SO_REUSEPORT``: the kernel
spreads new connections over the workers. Routers are stateless between requests (bindings,
sessions, session quotas and the requests running per session live in Redis), so N workers
behave like N routers behind a balancer; what one worker counts for itself
(``client_max_in_flight``, the rate limit, ``/metrics``) is per worker.

:func:`supervise` is the parent: it starts the workers (``python -m router --worker K``, the
same environment; port 0 is resolved to one free port first), forwards SIGINT/SIGTERM to them,
and exits once all have exited. If a worker exits on its own, the parent stops the others and
exits with that worker's code (a process manager restarts the whole router; no half-sized
router keeps serving). On Linux each worker is also tied to the parent's life
(``PR_SET_PDEATHSIG``): a parent killed with SIGKILL takes its workers with it, no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import subprocess
import sys
from types import FrameType

log = logging.getLogger("router")

PR_SET_PDEATHSIG = 1


def worker_count(requested: int) -> int:
    """``requested`` workers; 0 means one per core this process may run on."""
    if requested > 0:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _reserve_port(host: str, port: int) -> tuple[socket.socket | None, int]:
    """For port 0: bind (not listen) a ``SO_REUSEPORT`` socket on a free port, held by the
    parent so the workers can all bind that port; else nothing to hold."""
    if port:
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock, int(sock.getsockname()[1])


def _tie_to(parent: int) -> None:
    """In the forked child before exec: SIGTERM when the parent dies (Linux)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(0)


def supervise(n: int, host: str, port: int) -> int:
    """Run ``n`` workers on ``host:port`` until a signal (or a worker's exit); returns the exit
    code (0 after a signal, else the first worker's code that exited on its own)."""
    held, port = _reserve_port(host, port)
    env = {**os.environ, "ROLLOUTPOOL_ROUTER_PORT": str(port)}
    parent = os.getpid()
    stopping = False
    children: dict[int, subprocess.Popen[bytes]] = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for k in range(n):
            child = subprocess.Popen(
                [sys.executable, "-m", "router", "--worker", str(k), "--of", str(n)],
                env=env,
                preexec_fn=lambda: _tie_to(parent),  # safe: the parent runs one thread
            )
            children[child.pid] = child
        log.info("router: %d workers on %s:%d, pids %s", n, host, port, sorted(children))
        while children:
            pid, status = os.wait()
            if children.pop(pid, None) is None:
                continue
            if not stopping:
                code = os.waitstatus_to_exitcode(status) or 1
                log.error("router worker %d exited (code %d): stopping the others", pid, code)
                stop(signal.SIGTERM, None)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held is not None:
            held.close()
    return code
