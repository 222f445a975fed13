"""``ReplicaSpec.command`` is pure: the argv/env of both flavours, checked without a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pool.launcher import LAUNCH_MARK, ReplicaSpec, count_launches, free_port, log_tail


def test_cpu_command_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    spec = ReplicaSpec(
        model=tmp_path / "m", cpu_bind="1", env={"EXTRA": "x"}, extra_args=("--seed", "3")
    )
    argv, env = spec.command(8123, tmp_path / "w", tmp_path / "rpc")
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[argv.index("--model") + 1] == str((tmp_path / "m").resolve())
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 * 1024 * 1024)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert {"--enforce-eager", "--enable-prefix-caching"} <= set(argv)
    assert argv[-2:] == ["--seed", "3"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["TMPDIR"] == str(tmp_path / "w" / "tmp")
    assert env["VLLM_RPC_BASE_PATH"] == str(tmp_path / "rpc")
    assert env["EXTRA"] == "x"


def test_gpu_command_builds_serve_with_weight_transfer(tmp_path: Path) -> None:
    spec = ReplicaSpec(
        model=tmp_path / "m",
        flavor="gpu",
        dtype="bfloat16",
        kv_cache_bytes=None,
        enforce_eager=False,
        cuda_visible_devices="1",
        weight_transfer_backend="nccl",
    )
    argv, env = spec.command(9000, tmp_path, tmp_path)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(spec.model)]
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "--kv-cache-memory-bytes" not in argv and "--enforce-eager" not in argv
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_helpers(tmp_path: Path) -> None:
    assert 0 < free_port() < 65536
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 2) == "line 98\nline 99\n"
    assert log_tail(tmp_path / "missing.log") == ""


def test_count_launches_counts_the_lines_spawn_writes(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert count_launches(log) == 0  # no log yet
    log.write_text(
        f"=== 2026-11-30T07:22:43 {LAUNCH_MARK} python -m vllm...\n"
        "INFO: rolloutpool launch: mentioned in server output, not a launch\n"
        f"=== 2026-11-30T07:26:49 {LAUNCH_MARK} python -m vllm...\n"
    )
    assert count_launches(log) == 2
