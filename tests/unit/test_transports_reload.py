"""``reload`` with checksums, the server faked at the HTTP seam: the refusals preflight owes
before anything is drained (no worker extension; a runtime layout the checkpoint's checksums
could never match), and the sender's checksums being what preflight read, even if the
checkpoint changed since (so the replica's load of the changed file is caught by validation).
The real replica is in ``tests/integration/test_checksum_validation.py``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.checkpoint import checkpoint_checksums, read_manifest
from pool.engine import VllmEngine
from pool.errors import PreflightFailed
from pool.types import WeightIdentity
from updater.transports.base import WeightsTarget
from updater.transports.reload import ReloadTransport


def checkpoint(directory: Path, value: float = 1.0) -> WeightsTarget:
    directory.mkdir(exist_ok=True)
    save_file(
        {"a.weight": np.full((4, 2), value, np.float32), "b.bias": np.zeros(4, np.float32)},
        str(directory / "model.safetensors"),
    )
    manifest = read_manifest(directory)
    ident = WeightIdentity(manifest_digest=manifest.digest, checkpoint_uri=str(directory))
    return WeightsTarget(identity=ident, path=directory, expected_manifest=manifest)


def server(layout: dict[str, list[object]] | None) -> tuple[VllmEngine, list[str]]:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        calls.append(f"{request.url.path} {body.get('method', '')}".strip())
        if request.url.path == "/is_paused":
            return httpx.Response(200, json={"is_paused": True})
        if body.get("method") == "rolloutpool_layout":
            if layout is None:  # vLLM without the extension: the worker has no such method
                return httpx.Response(500, json={"error": "'CPUWorker' has no attribute"})
            return httpx.Response(200, json={"results": [{"layout": layout, "device": "cpu"}]})
        return httpx.Response(200, json={"results": [None]})

    return VllmEngine("http://replica.test", transport=httpx.MockTransport(handler)), calls


LAYOUT: dict[str, list[object]] = {"a.weight": ["float32", [4, 2]], "b.bias": ["float32", [4]]}


async def test_preflight_refuses_a_replica_without_the_extension_or_another_layout(
    tmp_path: Path,
) -> None:
    t = checkpoint(tmp_path / "ckpt")
    for layout, match in (
        (None, "worker-extension-cls"),
        ({**LAYOUT, "a.weight": ["bfloat16", [4, 2]]}, "differ"),
        ({"a.weight": LAYOUT["a.weight"]}, "differ"),
    ):
        engine, calls = server(layout)
        with pytest.raises(PreflightFailed, match=match):
            await ReloadTransport(checksums=True).preflight(engine, t)
        assert calls == ["/collective_rpc rolloutpool_layout"]  # read-only, nothing else
        await engine.aclose()


async def test_the_transfer_offers_what_preflight_read(tmp_path: Path) -> None:
    t = checkpoint(tmp_path / "ckpt")
    read = checkpoint_checksums(t.path)
    engine, calls = server(LAYOUT)
    transport = ReloadTransport(checksums=True)
    await transport.preflight(engine, t)
    checkpoint(t.path, value=2.0)  # the files change after the check ...
    ev = await transport.transfer(engine, t)
    assert ev.checksums == read  # ... the sender still vouches for what it checked
    assert calls[-1] == "/collective_rpc reload_weights"
    await transport.preflight(engine, t)  # a new preflight reads the files again
    assert (await transport.transfer(engine, t)).checksums == checkpoint_checksums(t.path) != read
    assert (await ReloadTransport().transfer(engine, t)).checksums is None  # off by default
    await engine.aclose()
