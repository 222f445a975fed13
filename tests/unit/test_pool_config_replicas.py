"""The embedded pool's replicas (``rolloutpool up --config``): the defaults, and the
``replica`` fields that turn them into e.g. GPU replicas sharing one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rolloutpool.embedded import PoolConfig


def test_default_replicas_are_cpu_pinned_to_alternate_cores(tmp_path: Path) -> None:
    specs = [r.launch for r in PoolConfig(workdir=tmp_path).replica_configs(tmp_path / "m")]
    assert [s.flavor for s in specs if s] == ["cpu", "cpu"]
    assert [s.cpu_bind for s in specs if s] == ["0", "1"]
    assert all(s and s.enable_scale_out for s in specs)


def test_replica_fields_from_yaml_make_gpu_replicas(tmp_path: Path) -> None:
    text = """
replicas: 3
replica:
  flavor: gpu
  cuda_visible_devices: "0"
  enable_scale_out: false
  extra_args: [--gpu-memory-utilization, "0.2"]
"""
    c = PoolConfig(workdir=tmp_path, **yaml.safe_load(text))
    configs = c.replica_configs(tmp_path / "m")
    assert [r.id for r in configs] == ["replica-0", "replica-1", "replica-2"]
    for i, r in enumerate(configs):
        s = r.launch
        assert s is not None and s.flavor == "gpu" and s.cuda_visible_devices == "0"
        assert s.name == f"replica-{i}" and s.work_dir == tmp_path / f"replica-{i}"
        argv, env = s.command(8000, tmp_path, tmp_path)
        assert "vllm.entrypoints.cli.main" in argv and "--enable-scale-out" not in argv
        assert argv[-2:] == ["--gpu-memory-utilization", "0.2"]
        assert env["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"flavour": "gpu"}, "flavour"),
        ({"name": "x", "work_dir": "/tmp"}, "name"),
        ({"flavor": "tpu"}, "flavor"),  # a bad value: refused when the config is read
    ],
)
def test_unknown_or_per_replica_fields_are_refused(
    fields: dict[str, str], named: str, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match=named):
        PoolConfig(workdir=tmp_path, replica=fields)
