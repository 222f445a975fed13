"""``updater.transports.nccl.config``: what the NCCL settings accept and the rendezvous ports."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from updater.transports.nccl import NcclConfig


def test_config_validation_and_ports() -> None:
    c = NcclConfig(master_port=30000, replica_ports={"http://b:8000/": 31000}, port_stride=10)
    assert c.port_for("http://a:8000", 0, 0) == 30000
    assert c.port_for("http://c:8000", 2, 0) == 30002
    assert c.port_for("http://b:8000", 1, 0) == 31000  # explicit, trailing slash normalised
    assert c.port_for("http://b:8000", 1, 3) == 31030  # a new port per abandoned group
    with pytest.raises(ValueError):
        c.port_for("http://a:8000", 0, c.max_incarnations)
    with pytest.raises(ValueError, match="out of range"):
        NcclConfig(master_port=65530, port_stride=100).port_for("http://a", 0, 1)
    for bad in (
        {"master_port": 80},
        {"master_address": ""},
        {"device": "cpu"},
        {"replica_ports": {"http://a": 30000, "http://b": 30000}},
        {"replica_ports": {"http://a": 99}},
        {"init_timeout_s": 0},
        {"packing": {"buffer_bytes": 0}},
        {"packing": {"num_buffers": 0}},
        {"unknown": 1},
    ):
        with pytest.raises(ValidationError):
            NcclConfig(**bad)
