"""Ports for servers this process starts are picked outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from pool.ports import PORT_RANGE, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_binds() -> None:
    """An ephemeral port can become the local end of any outgoing connection while a server
    starts (a vLLM replica bound a minute later and got "Address already in use")."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(PORT_RANGE[0] <= p < lo for p in ports), ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))
