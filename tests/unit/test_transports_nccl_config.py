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


def test_wave_ports_lie_past_every_per_replica_port() -> None:
    c = NcclConfig(master_port=30000, port_stride=10, max_incarnations=5)
    last_replica_port = c.port_for("http://a", 9, c.max_incarnations - 1)
    assert c.wave_port_for(0, 0) == 30050 > last_replica_port
    assert c.wave_port_for(2, 1) == 30062  # wave 2, its second group
    assert NcclConfig(wave_port=40000).wave_port_for(1, 0) == 40001
    with pytest.raises(ValueError, match="different waves"):
        c.wave_port_for(10, 0)
    with pytest.raises(ValueError, match="abandoned"):
        c.wave_port_for(0, 5)
    with pytest.raises(ValueError, match="out of range"):
        NcclConfig(master_port=65000).wave_port_for(0, 0)
