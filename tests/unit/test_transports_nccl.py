"""The ``nccl`` transport without a GPU: what can be checked on a CPU machine.

The real data path (vLLM's trainer helpers, NCCL, a ``vllm serve`` on a GPU) runs in
``tests/gpu`` and ``bench/gpu_update.py``. Here the server is faked at the HTTP seam
(``httpx.MockTransport``, the same routes and blocking behaviour as vLLM 0.26's dev routes) and
the trainer side by a fake :class:`~updater.transports.nccl.Sender` (it records the typed
commands that would reach vLLM's helpers). That covers the transport's own logic: refusals before
any HTTP call, the handshake order and bodies of both API families, group reuse, and what a stuck
or failing collective does (bounded by the watchdog, group abandoned, a new port next time). The
package's parts have their own files: ``test_transports_nccl_{config,versions,sources,control,
senders}.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.checkpoint import read_manifest
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, DeadlineExceeded, NoMutation, PreflightFailed
from pool.types import Manifest, TensorSpec, WeightIdentity
from updater.deadline import bounded
from updater.transports.base import WeightsTarget
from updater.transports.nccl import (
    CheckpointSource,
    NcclConfig,
    NcclTransport,
    Packing,
    Sender,
    WeightSource,
)
from updater.transports.nccl.senders import (
    Command,
    FactoryInit,
    FactorySend,
    Prepare,
    Rendezvous,
    StaticInit,
    StaticSend,
)

SPECS = [
    TensorSpec(name="model.embed_tokens.weight", shape=(64, 8), dtype="bfloat16"),
    TensorSpec(name="model.layers.0.self_attn.q_proj.weight", shape=(8, 8), dtype="bfloat16"),
    TensorSpec(name="model.norm.weight", shape=(8,), dtype="bfloat16"),
]
NBYTES = (64 * 8 + 8 * 8 + 8) * 2


class SpecSource(WeightSource):
    """A source that only declares parameters (the fake sender never iterates it)."""

    def __init__(self, specs: list[TensorSpec] | None = None) -> None:
        self._specs = list(SPECS if specs is None else specs)

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        raise AssertionError("the fake sender never iterates")


class FakeSender(Sender):
    """Stands in for vLLM's trainer helpers (a :class:`Sender` whose commands never reach a
    core): joins when the server's init arrives, 'sends' when the server's update arrives;
    ``hang`` makes the send block until the group is abandoned (as ncclCommAbort unblocks a
    stuck broadcast). Records every command it was given."""

    def __init__(self, server: FakeServer, hang: bool = False) -> None:
        self.server, self.hang = server, hang
        self.commands: list[Command[Any]] = []
        self.abandoned: list[str] = []
        self.unblock = threading.Event()

    def run(self, command: Command[Any]) -> Any:
        self.commands.append(command)
        match command:
            case StaticInit():
                assert self.server.init_seen.wait(5), "server never got the init"
                return 0.01
            case StaticSend():
                if self.hang:
                    self.unblock.wait(30)
                    raise RuntimeError("communicator aborted")
                assert self.server.update_seen.wait(5), "server never got the update"
                self.server.data_sent.set()
                return {"send_s": 0.01, "send_enqueue_s": 0.005}
            case FactoryInit():
                return 0.0
            case FactorySend():
                return {"send_s": 0.02}
        return None

    def kinds(self) -> list[str]:
        return [type(c).__name__ for c in self.commands]

    def abandon(self, key: str) -> None:
        self.abandoned.append(key)
        self.unblock.set()

    def close(self) -> None:
        self.unblock.set()


class FakeServer:
    """vLLM 0.26 dev routes at the HTTP seam, with the real blocking: init waits for the
    trainer's join, update waits for the data (or forever when the sender hangs)."""

    def __init__(
        self, version: str = "0.26.0", paused: bool = True, fail: dict[str, int] | None = None
    ) -> None:
        self.version, self.paused, self.fail = version, paused, fail or {}
        #: what the worker extension reports (None: no extension loaded)
        self.layout: dict[str, Any] | None = {s.name: [s.dtype, list(s.shape)] for s in SPECS}
        self.flip: str | None = None  # a name whose received checksum comes out different
        self.requests: list[tuple[str, str, Any]] = []
        self.init_seen, self.update_seen = threading.Event(), threading.Event()
        self.data_sent, self.release = threading.Event(), threading.Event()

    def replica_checksums(self, names: list[list[Any]]) -> dict[str, Any]:
        """What the extension's receive reports: one checksum per received name."""
        sums = {}
        for i, (name, dtype, shape) in enumerate(names):
            sums[name] = [dtype, shape, i, 2 * i + (name == self.flip)]
        return sums

    def paths(self) -> list[str]:
        return [f"{m} {p}" for m, p, _ in self.requests]

    def body(self, path: str) -> Any:
        return next(b for _, p, b in self.requests if p == path)

    def init_ports(self) -> list[int]:
        """The rendezvous port of every group init received, in order."""
        return [
            b["init_info"]["master_port"]
            for _, p, b in self.requests
            if p == "/init_weight_transfer_engine"
        ]

    def rearm(self) -> None:
        """Ready for another update: the next one waits for its own data again."""
        self.update_seen.clear()
        self.data_sent.clear()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, path, body))
        if path in self.fail:
            if path == "/update_weights":
                self.update_seen.set()
            return httpx.Response(self.fail[path], json={"error": "injected"})
        if path == "/version":
            return httpx.Response(200, json={"version": self.version})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "test"}]})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/get_world_size":
            return httpx.Response(200, json={"world_size": 1})
        if path == "/init_weight_transfer_engine":
            self.init_seen.set()
            return httpx.Response(200, json={"message": "Weight transfer initialized"})
        if path == "/update_weights" or (
            path == "/collective_rpc" and body["method"] == "rolloutpool_direct_receive"
        ):
            self.update_seen.set()
            if not self.data_sent.wait(5):  # the broadcast never came: vLLM would hang
                self.release.wait(30)
                return httpx.Response(500, json={"error": "released"})
            if path == "/update_weights":
                return httpx.Response(200, json={"message": "Weights updated"})
            names = json.loads(body["kwargs"]["names"])
            got: dict[str, Any] = {"received": len(names)}
            if json.loads(body["kwargs"].get("checksums", "false")):
                got["checksums"] = self.replica_checksums(names)
            return httpx.Response(200, json={"results": [got]})
        if path == "/collective_rpc":  # the worker extension (pool.replica_extension)
            if self.layout is None:
                return httpx.Response(500, json={"error": "Worker has no attribute"})
            if body["method"] == "rolloutpool_direct_init":
                self.init_seen.set()
            return httpx.Response(200, json={"results": [{"layout": self.layout}]})
        return httpx.Response(200, json={"message": "ok"})


def make(
    server: FakeServer,
    source: WeightSource | None = None,
    *,
    hang: bool = False,
    local: str = "0.26.0",
    **cfg: Any,
) -> tuple[NcclTransport, VllmEngine, FakeSender]:
    mock = httpx.MockTransport(server)
    sender = FakeSender(server, hang=hang)
    transport = NcclTransport(
        NcclConfig(**cfg),
        SpecSource() if source is None else source,
        sender_impl=sender,
        http_transport=mock,
        local_version=local,
    )
    engine = VllmEngine("http://replica.test", timeout=5.0, transport=mock)
    return transport, engine, sender


def target(
    specs: list[TensorSpec] | None = None,
    path: Path = Path("/in-process"),
    digest: str | None = None,
) -> WeightsTarget:
    m = Manifest.of(SPECS if specs is None else specs)
    ident = WeightIdentity(manifest_digest=digest or m.digest, checkpoint_uri=str(path), step=1)
    return WeightsTarget(identity=ident, path=path, expected_manifest=Manifest.of(SPECS))


# ------------------------------------------------------------------------------ pure parts


def test_settings_and_transports_load_without_torch_or_vllm() -> None:
    """Pins the lazy imports: loading the settings, the registry and the transports, and
    building the NCCL transport (what the updater does at start) import neither."""
    code = (
        "import sys\n"
        "from updater.settings import UpdaterSettings\n"
        "from updater.transports import preflight, registry, reload, nccl\n"
        "registry.create(UpdaterSettings(transport='nccl')).close()\n"
        "bad = [m for m in ('torch', 'vllm', 'safetensors.torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def service_checkpoint(directory: Path) -> WeightsTarget:
    """A float32 checkpoint written without torch, and the target that names it."""
    directory.mkdir()
    save_file(
        {"a.weight": np.zeros((4, 2), np.float32), "b.bias": np.zeros(4, np.float32)},
        str(directory / "model.safetensors"),
    )
    manifest = read_manifest(directory)
    ident = WeightIdentity(manifest_digest=manifest.digest, checkpoint_uri=str(directory))
    return WeightsTarget(identity=ident, path=directory, expected_manifest=manifest)


async def test_service_mode_checks_the_targets_checkpoint_then_loads_it(tmp_path: Path) -> None:
    ok = service_checkpoint(tmp_path / "ckpt")
    server = FakeServer()
    transport, engine, sender = make(server, local="0.26.0")
    transport.source = None  # service mode: the target's checkpoint
    refusals = {
        "does not exist": replace(ok, path=tmp_path / "missing"),
        "absolute": replace(ok, path=Path("rel")),
        "checkpoint_uri": replace(
            ok, identity=ok.identity.model_copy(update={"checkpoint_uri": "/other"})
        ),
    }
    for match, bad in refusals.items():
        with pytest.raises(PreflightFailed, match=match):
            await transport.preflight(engine, bad)
    assert server.requests == [] and sender.commands == []
    await transport.preflight(engine, ok)
    [prepare] = sender.commands  # loaded onto the sender's GPU before the paused window
    assert isinstance(prepare, Prepare) and isinstance(prepare.source, CheckpointSource)
    assert (prepare.source.path, prepare.source.device) == (ok.path, transport.config.device)
    wrong_hash = ok.identity.model_copy(update={"content_hash": "sha256:" + "1" * 64})
    await transport.preflight(engine, replace(ok, identity=wrong_hash))  # not verified by default
    transport.config = transport.config.model_copy(update={"verify_content_hash": True})
    with pytest.raises(PreflightFailed, match="declared content hash"):
        await transport.preflight(engine, replace(ok, identity=wrong_hash))
    await engine.aclose()


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "specs",
    [
        [*SPECS[:2], TensorSpec(name="model.norm.weight", shape=(9,), dtype="bfloat16")],
        [*SPECS[:2], TensorSpec(name="model.norm.weight", shape=(8,), dtype="float32")],
        SPECS[:2],
        [*SPECS, TensorSpec(name="lm_head.weight", shape=(64, 8), dtype="bfloat16")],
        [*SPECS, SPECS[0]],
    ],
    ids=["shape", "dtype", "missing", "extra", "duplicate"],
)
async def test_manifest_mismatch_is_refused_before_any_http_call(specs: list[TensorSpec]) -> None:
    server = FakeServer()
    transport, engine, sender = make(server, SpecSource(specs))
    with pytest.raises(PreflightFailed):
        await transport.preflight(engine, target())
    with pytest.raises(PreflightFailed):
        await transport.transfer(engine, target())
    assert server.requests == [] and sender.commands == []
    await engine.aclose()


async def test_identity_and_version_refusals() -> None:
    server = FakeServer()
    transport, engine, sender = make(server)
    with pytest.raises(PreflightFailed, match="identity mismatch"):
        await transport.transfer(engine, target(digest="sha256:not-this-one"))
    assert server.requests == []
    for local, version in (("0.28.0", "0.26.0"), ("0.26.0", "0.27.0")):
        server = FakeServer(version=version)
        transport, engine, sender = make(server, local=local)
        with pytest.raises(PreflightFailed):
            await transport.preflight(engine, target())
        with pytest.raises(PreflightFailed):
            await transport.transfer(engine, target())
        assert {p for p in server.paths()} <= {"GET /version", "GET /v1/models"}
        assert sender.commands == []
        await engine.aclose()


class CountingSource(SpecSource):
    """Counts how often its parameters are read (each read is one manifest check)."""

    reads = 0

    def specs(self) -> list[TensorSpec]:
        self.reads += 1
        return super().specs()


async def test_the_target_is_checked_once_per_transfer_path() -> None:
    """Pins the single check: the transfer that follows a preflight of the same target uses what
    the preflight checked; a transfer without it checks itself; another target is checked."""
    server = FakeServer()
    src = CountingSource()
    transport, engine, _sender = make(server, src)
    await transport.preflight(engine, target())
    await transport.transfer(engine, target())
    assert src.reads == 1
    server.rearm()
    await transport.transfer(engine, target())  # no preflight this time
    assert src.reads == 2
    await transport.preflight(engine, target())
    with pytest.raises(PreflightFailed, match="identity mismatch"):
        await transport.transfer(engine, target(digest="sha256:other"))
    assert src.reads == 4
    await engine.aclose()


async def test_unpaused_engine_is_no_mutation() -> None:
    server = FakeServer(paused=False)
    transport, engine, sender = make(server)
    with pytest.raises(NoMutation, match="not paused"):
        await transport.transfer(engine, target())
    assert "POST /start_weight_update" not in server.paths() and sender.commands == []
    await engine.aclose()


async def test_refused_group_init_is_no_mutation_and_moves_the_port() -> None:
    server = FakeServer(fail={"/init_weight_transfer_engine": 400})
    server.init_seen.set()  # let the fake trainer 'join'
    transport, engine, _sender = make(server, master_port=30000, port_stride=10)
    with pytest.raises(NoMutation, match="refused"):
        await transport.transfer(engine, target())
    assert "POST /start_weight_update" not in server.paths()
    assert server.body("/init_weight_transfer_engine")["init_info"]["master_port"] == 30000
    server.fail.clear()
    await transport.transfer(engine, target())
    assert server.init_ports() == [30000, 30010]
    await engine.aclose()


# ------------------------------------------------------------------------------ the handshake


async def test_static_handshake_order_bodies_and_group_reuse() -> None:
    server = FakeServer()
    transport, engine, sender = make(
        server,
        master_address="10.0.0.5",
        master_port=30100,
        packing=Packing(buffer_bytes=256 << 20, num_buffers=4),
    )
    await transport.preflight(engine, target())
    assert server.paths() == ["GET /version", "GET /v1/models"]  # read-only
    ev = await transport.transfer(engine, target())
    assert ev.ok and ev.transport == "nccl" and ev.bytes == NBYTES
    assert ev.identity_digest == target().identity.digest
    assert server.paths()[2:] == [
        "GET /is_paused",
        "GET /get_world_size",
        "POST /init_weight_transfer_engine",
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
    ]
    init = server.body("/init_weight_transfer_engine")["init_info"]
    assert init == {
        "master_address": "10.0.0.5",
        "master_port": 30100,
        "rank_offset": 1,
        "world_size": 2,
    }
    upd = server.body("/update_weights")["update_info"]
    assert upd == {
        "names": [s.name for s in SPECS],
        "dtype_names": ["bfloat16"] * 3,
        "shapes": [[64, 8], [8, 8], [8]],
        "packed": True,
        "packed_buffer_size_bytes": 256 << 20,
        "packed_num_buffers": 4,
    }
    key = "http://replica.test#0"
    assert sender.commands[0] == StaticInit(Rendezvous(key, "10.0.0.5", 30100, 2))
    send = sender.commands[1]
    assert isinstance(send, StaticSend) and send.key == key
    assert send.packing == transport.packing and send.chunk_timings is False
    detail = json.loads(ev.detail)
    assert detail["family"] == "static" and detail["world_size"] == 2
    assert transport.last["http://replica.test"]["step"] == "done"

    # the second transfer reuses the group: no init, same key
    server.requests.clear()
    server.rearm()
    await transport.transfer(engine, target())
    assert "POST /init_weight_transfer_engine" not in server.paths()
    assert sender.kinds() == ["StaticInit", "StaticSend", "StaticSend"]
    assert sender.abandoned == []
    await engine.aclose()


async def test_stuck_collective_is_bounded_by_the_watchdog_and_abandoned() -> None:
    server = FakeServer()
    transport, engine, sender = make(server, hang=True, master_port=30200, port_stride=7)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await bounded("transfer", transport.transfer(engine, target()), 1.0, mutating=True)
    took = time.monotonic() - t0
    assert took < 3.0, took
    # the watchdog cancels and moves on; the abandoned task unwinds soon after (bounded wait)
    for _ in range(200):
        if sender.abandoned and "http://replica.test" in transport.last:
            break
        await asyncio.sleep(0.01)
    assert sender.abandoned == ["http://replica.test#0"]
    assert transport.last["http://replica.test"]["step"] == "update"

    # the next transfer (after the replica's recovery) builds a new group on a new port
    sender.hang = False
    fresh = FakeServer()
    transport._http_transport = httpx.MockTransport(fresh)
    sender.server = fresh
    engine2 = VllmEngine("http://replica.test", timeout=5.0, transport=httpx.MockTransport(fresh))
    await transport.transfer(engine2, target())
    assert fresh.body("/init_weight_transfer_engine")["init_info"]["master_port"] == 30207
    server.release.set()
    await engine.aclose()
    await engine2.aclose()


async def test_failed_update_is_ambiguous_and_ends_before_the_deadline() -> None:
    server = FakeServer(fail={"/update_weights": 500})
    transport, engine, sender = make(server, hang=True)
    t0 = time.monotonic()
    with pytest.raises(AmbiguousMutation, match="update_weights"):
        await bounded("transfer", transport.transfer(engine, target()), 30.0, mutating=True)
    assert time.monotonic() - t0 < 5.0
    assert sender.abandoned == ["http://replica.test#0"]
    assert "POST /finish_weight_update" not in server.paths()
    await engine.aclose()


async def test_forget_abandons_the_group() -> None:
    server = FakeServer()
    transport, engine, sender = make(server, master_port=30300, port_stride=5)
    await transport.transfer(engine, target())
    transport.forget("http://replica.test/")
    assert sender.abandoned == ["http://replica.test#0"]
    server.rearm()
    await transport.transfer(engine, target())
    assert server.init_ports() == [30300, 30305]
    await engine.aclose()


async def test_factory_api_for_028_and_later() -> None:
    server = FakeServer(version="0.28.0")
    transport, engine, sender = make(server, local="0.28.0", master_port=30400)
    ev = await transport.transfer(engine, target())
    assert ev.ok and json.loads(ev.detail)["family"] == "factory"
    assert sender.kinds() == ["FactoryInit", "FactorySend"]
    init = sender.commands[0]
    assert isinstance(init, FactoryInit)
    assert init.at == Rendezvous("http://replica.test#0", "127.0.0.1", 30400, 2)
    assert init.packing == transport.packing
    assert init.client.base_url == "http://replica.test"
    assert init.client.init_timeout_s == transport.config.init_timeout_s
    # vLLM's engine drives start/update/finish through the client: the transport sends none
    assert not {"POST /start_weight_update", "POST /update_weights"} & set(server.paths())
    # packing rides the init info from 0.28 on: a new packing means a new group
    await transport.transfer(engine, target())
    transport.packing = Packing(buffer_bytes=512 << 20)
    await transport.transfer(engine, target())
    assert sender.kinds() == [
        "FactoryInit",
        "FactorySend",
        "FactorySend",
        "FactoryInit",
        "FactorySend",
    ]
    assert sender.abandoned == ["http://replica.test#0"]
    await engine.aclose()


def test_process_sender_needs_a_rebuildable_source() -> None:
    with pytest.raises(ValueError, match="spec"):
        NcclTransport(NcclConfig(), SpecSource(), sender="process")
