"""Ports for servers this process starts (replicas, Redis in tests and the embedded pool)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where :func:`free_port` looks: above Ray's worker ports (10002-19999 by default), below the
#: kernel's ephemeral range (``ip_local_port_range``, 32768 and up by default).
PORT_RANGE = (20000, 32767)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORT_RANGE[1] + 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for a server started next.

    Picked at random below the kernel's ephemeral range: a port from that range (what binding
    to port 0 gives) may be taken as the local end of any outgoing connection in the time a
    server takes to start (a vLLM replica: up to a minute), and was seen to be ("Address already
    in use"). Falls back to port 0's answer if no port of the range binds."""
    hi = min(PORT_RANGE[1], _ephemeral_floor() - 1)
    for _ in range(64 if hi > PORT_RANGE[0] else 0):
        port = random.randint(PORT_RANGE[0], hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        free: int = s.getsockname()[1]
        return free


__all__ = ["PORT_RANGE", "free_port"]
