"""``ipc_direct`` without a GPU: the sender's staging (:class:`IpcStaging`) on CPU tensors, the
replica's worker extension (:mod:`pool.replica_extension` on a CPU stand-in of a vLLM model,
fused q/k/v and gate/up blocks included) behind vLLM's ``/collective_rpc`` faked at the HTTP
seam, and the transport between them. Only the CUDA IPC export/open is replaced (a handle that
names the staging buffer of this process); the GPU path is ``tests/gpu/test_ipc_gpu.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import pool.replica_extension as ext
from pool.checksum import tensor_checksums
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.evidence import ChecksumEvidence, TransferEvidence
from pool.ipc_handles import ALIGN_BYTES, HEADER_BYTES, Entry, IpcHandle, read_tag
from pool.types import Manifest, TensorSpec, WeightIdentity
from tests.unit.test_replica_extension import checkpoint, runtime, worker_class
from updater.transports.base import Transport, WeightsTarget
from updater.transports.ipc import SIDECAR, IpcDirectTransport, IpcStaging
from updater.transports.ipc import staging as staging_mod


def fake_handle(buffer: torch.Tensor) -> IpcHandle:
    """A handle naming ``buffer`` of this process (what CUDA IPC would export)."""
    return IpcHandle(
        "GPU-fake", buffer.numel(), str(buffer.data_ptr()), 0, 0, 0, "", 0, None, False
    )


class Registry:
    """CUDA IPC stand-in: export names a buffer, open finds it (or refuses, like an
    unreachable GPU)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.refuse = ""

    def export(self, buffer: torch.Tensor) -> IpcHandle:
        h = fake_handle(buffer)
        self.buffers[h.handle] = buffer
        return h

    def open(self, h: IpcHandle) -> tuple[Any, str]:
        if self.refuse:
            return None, self.refuse
        return self.buffers[h.handle], ""


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> Registry:
    reg = Registry()
    monkeypatch.setattr(staging_mod, "export_buffer", reg.export)
    monkeypatch.setattr(ext, "_open_ipc", reg.open)
    return reg


class Server:
    """vLLM's dev routes the transport uses, calling a real WeightExtension worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.paused = True
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        assert request.url.path == "/collective_rpc", request.url.path
        body = json.loads(request.content)
        self.calls.append(body["method"])
        try:
            result = getattr(self.worker, body["method"])(**body["kwargs"])
        except Exception as e:  # vLLM: a worker exception is a 500
            return httpx.Response(500, json={"error": f"{type(e).__name__}: {e}"})
        return httpx.Response(200, json={"results": [json.loads(json.dumps(result))]})


def setup(
    ipc: Registry, *, slots: int = 2, transport: type[IpcDirectTransport] = IpcDirectTransport
) -> tuple[Any, IpcStaging, IpcDirectTransport, VllmEngine, Server, WeightsTarget, Any]:
    ckpt = checkpoint(torch.bfloat16)
    old = {n: torch.zeros_like(t) for n, t in ckpt.items()}
    model = runtime(old, repacked=False)
    server = Server(worker_class()(model))
    engine = VllmEngine("http://replica.test", timeout=5.0, transport=httpx.MockTransport(server))
    manifest = Manifest.of(
        [TensorSpec(name=n, shape=tuple(t.shape), dtype="bfloat16") for n, t in ckpt.items()]
    )
    ident = WeightIdentity(manifest_digest=manifest.digest, checkpoint_uri="trainer://g1", step=1)
    target = WeightsTarget(ident, Path("/in-process/g1"), manifest)
    staging = IpcStaging(slots=slots)
    staging.stage(list(ckpt.items()), key=ident.digest)
    return model, staging, transport(staging), engine, server, target, ckpt


def served(model: Any) -> dict[str, torch.Tensor]:
    return dict(ext.runtime_views(model, writable=False))


# ------------------------------------------------------------------------------ staging


def test_staging_lays_out_aligned_copies_with_a_tag_and_keeps_the_newest_slots() -> None:
    ckpt = checkpoint(torch.bfloat16)
    staging = IpcStaging(slots=2)
    a = staging.stage(list(ckpt.items()), key="a")
    assert [e.name for e in a.entries] == list(ckpt)
    assert a.entries[0].offset == HEADER_BYTES
    assert all(e.offset % ALIGN_BYTES == 0 for e in a.entries)
    assert read_tag(staging.buffer(a)) == a.tag > 0
    for name, view in staging.views(a):
        assert torch.equal(view, ckpt[name])
    assert staging.checksums(a) == tensor_checksums(ckpt.items())
    ckpt2 = {n: t + 1 for n, t in ckpt.items()}
    b = staging.stage(list(ckpt2.items()), key="b")
    assert b.slot != a.slot and b.tag != a.tag
    assert staging.holds(a) and staging.find("a") == a and staging.find("b") == b
    c = staging.stage(list(ckpt2.items()), key="c")  # reuses a's slot (same shapes)
    assert c.slot == a.slot and not staging.holds(a) and staging.find("a") is None
    with pytest.raises(LookupError):
        staging.views(a)
    shard = ("model.layers.0.mlp.up_proj.weight", 0, 2, 3)
    got = staging.shard_checksums(c, (shard,))
    assert list(got.values()) == list(
        tensor_checksums([("x", ckpt2[shard[0]].narrow(0, 2, 3))]).values()
    )


def test_the_descriptor_round_trips_as_json(ipc: Registry) -> None:
    staging = IpcStaging(slots=1)
    copy = staging.stage(list(checkpoint().items()), key="k")
    desc = staging.descriptor(copy)
    again = staging_mod.IpcDescriptor.model_validate_json(desc.model_dump_json())
    assert again.parsed_entries() == list(copy.entries)
    assert again.ipc_handle() == staging.handle(copy) and again.tag == copy.tag
    assert again.manifest_digest == copy.manifest().digest


# ------------------------------------------------------------------------------ transfers


async def test_a_transfer_copies_every_tensor_in_place_with_checksums(ipc: Registry) -> None:
    model, _staging, transport, engine, server, target, ckpt = setup(ipc)
    await transport.preflight(engine, target)
    assert server.calls == ["rolloutpool_layout", "rolloutpool_ipc_check"]
    ev = await transport.transfer(engine, target)
    assert isinstance(ev, TransferEvidence) and ev.transport == "ipc_direct"
    for name, t in served(model).items():
        assert torch.equal(t, ckpt[name]), name
    evidence = ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {})
    assert evidence.proves_equal and evidence.compared == len(ckpt)
    receive = transport.last[engine.url]["receive"][0]
    # q/k/v land in one fused parameter, gate/up in another: 3 + 2 tensors, 2 copies
    assert receive["received"] == len(ckpt) and receive["copies"] == len(ckpt) - 3


async def test_one_flipped_bit_in_the_staged_copy_is_caught_by_the_checksums(
    ipc: Registry,
) -> None:
    _model, staging, transport, engine, _server, target, _ckpt = setup(ipc)
    await transport.preflight(engine, target)  # the sender's checksums: the intact copy
    copy = staging.find(target.identity.digest)
    assert copy is not None
    k = next(e for e in copy.entries if e.name.endswith("k_proj.weight"))
    staging.buffer(copy)[k.offset + 5] ^= 1
    ev = await transport.transfer(engine, target)
    evidence = ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {})
    assert evidence.mismatched == 1 and evidence.examples == (k.name,)


async def test_a_cut_transfer_is_caught_by_the_checksums(ipc: Registry) -> None:
    class Cut(IpcDirectTransport):
        def _send_entries(self, entries: list[Entry]) -> list[Entry]:
            return entries[:-2]

    _model, _staging, transport, engine, _server, target, _ckpt = setup(ipc, transport=Cut)
    ev = await transport.transfer(engine, target)  # no preflight: it checks itself
    evidence = ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {})
    assert evidence.missing == 2 and not evidence.proves_equal


async def test_a_copy_whose_checksums_are_unreadable_is_ambiguous(ipc: Registry) -> None:
    """The worker copied, then answered checksums that are not the JSON string it sends: the
    weights changed, and nothing proves which: AmbiguousMutation."""
    model, _staging, transport, engine, server, target, ckpt = setup(ipc)
    real = server.worker.rolloutpool_ipc_copy

    def garbled(**kw: str) -> dict[str, Any]:
        out = dict(real(**kw))
        out["checksums"] = "{not json"
        return out

    server.worker.rolloutpool_ipc_copy = garbled
    with pytest.raises(AmbiguousMutation, match="checksums are unreadable"):
        await transport.transfer(engine, target)
    assert all(torch.equal(t, ckpt[n]) for n, t in served(model).items())


async def test_refusals_before_any_write_are_no_mutation(ipc: Registry) -> None:
    model, staging, transport, engine, server, target, _ckpt = setup(ipc, slots=1)
    await transport.preflight(engine, target)
    server.paused = False
    with pytest.raises(NoMutation, match="not paused"):
        await transport.transfer(engine, target)
    server.paused = True
    await transport.preflight(engine, target)
    before = {n: t.clone() for n, t in served(model).items()}
    # the slot was restaged under the same key: the replica was planned for the old copy
    plan = transport._plans[engine.url]
    staging.stage(list(checkpoint(torch.bfloat16).items()), key=target.identity.digest)
    transport._plans[engine.url] = plan
    with pytest.raises(NoMutation, match="no longer holds"):
        await transport.transfer(engine, target)
    assert all(torch.equal(t, before[n]) for n, t in served(model).items())
    server.worker.rolloutpool_ipc_close()
    ipc.refuse = "unreachable staging buffer: GPU GPU-fake is not visible to this process"
    transport._plans[engine.url] = plan
    with pytest.raises(NoMutation, match="unreachable"):
        await transport.transfer(engine, target)
    with pytest.raises(PreflightFailed, match="unreachable"):
        await transport.preflight(engine, target)
    assert all(torch.equal(t, before[n]) for n, t in served(model).items())


async def test_a_buffer_rewritten_during_the_copy_is_ambiguous(
    ipc: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    _model, staging, transport, engine, _server, target, _ckpt = setup(ipc)
    await transport.preflight(engine, target)
    tags = iter([staging.find(target.identity.digest).tag, 0])  # type: ignore[union-attr]
    monkeypatch.setattr(ext, "read_tag", lambda buffer: next(tags))
    with pytest.raises(AmbiguousMutation, match="torn"):
        await transport.transfer(engine, target)


async def test_nothing_staged_is_refused_in_preflight_without_a_fallback(ipc: Registry) -> None:
    _model, _staging, transport, engine, server, target, _ckpt = setup(ipc)
    other = WeightsTarget(
        WeightIdentity(manifest_digest=target.identity.manifest_digest, checkpoint_uri="x://2"),
        target.path,
        target.expected_manifest,
    )
    with pytest.raises(PreflightFailed, match="nothing staged"):
        await transport.preflight(engine, other)
    assert server.calls == []


# ------------------------------------------------------------------------------ service mode


class Recorder(Transport):
    """A fallback that records what it was asked."""

    name = "reload"

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        self.calls.append("preflight")

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        self.calls.append("transfer")
        return TransferEvidence("reload", target.identity.digest, True, 0, 0.0, "")


async def test_service_mode_reads_the_sidecar_and_falls_back_without_a_usable_copy(
    ipc: Registry, tmp_path: Path
) -> None:
    _model, staging, _, engine, _server, target, ckpt = setup(ipc)
    fallback = Recorder()
    transport = IpcDirectTransport(fallback=fallback)
    ckpt_dir = tmp_path / "step-1"
    ckpt_dir.mkdir()
    target = WeightsTarget(target.identity, ckpt_dir, target.expected_manifest)
    await transport.preflight(engine, target)  # no sidecar: the checkpoint it is
    await transport.transfer(engine, target)
    assert fallback.calls == ["preflight", "transfer"]
    assert "does not exist" in transport.last[engine.url]["why"]
    copy = staging.find(target.identity.digest)
    assert copy is not None
    (ckpt_dir / SIDECAR).write_text(staging.descriptor(copy).model_dump_json())
    await transport.preflight(engine, target)
    ev = await transport.transfer(engine, target)
    assert ev.transport == "ipc_direct" and fallback.calls == ["preflight", "transfer"]
    assert ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {}).proves_equal
    staging.stage(list(ckpt.items()), key="next")
    staging.stage(list(ckpt.items()), key="after")  # both slots rewritten: the copy is gone
    await transport.preflight(engine, target)
    await transport.transfer(engine, target)
    assert fallback.calls[-2:] == ["preflight", "transfer"]
    assert "holds copy" in transport.last[engine.url]["why"]


# ------------------------------------------------------------------------------ kept plans


async def test_later_transfers_reuse_the_plan_and_still_catch_a_flipped_bit(
    ipc: Registry,
) -> None:
    _model, staging, transport, engine, _server, target, _ckpt = setup(ipc)
    await transport.transfer(engine, target)
    assert transport.last[engine.url]["receive"][0]["plan_cached"] is False
    copy = staging.find(target.identity.digest)
    assert copy is not None
    v = next(e for e in copy.entries if e.name.endswith("v_proj.weight"))
    staging.buffer(copy)[v.offset + 3] ^= 4
    ev = await transport.transfer(engine, target)
    receive = transport.last[engine.url]["receive"][0]
    assert receive["plan_cached"] is True
    assert {"plan_s", "queue_s", "run_s", "worker_s"} <= receive.keys()
    evidence = ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {})
    assert evidence.mismatched == 1 and evidence.examples == (v.name,)


async def test_moved_parameters_and_closed_buffers_get_a_new_plan(ipc: Registry) -> None:
    model, _staging, transport, engine, server, target, ckpt = setup(ipc)
    await transport.transfer(engine, target)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    qkv.data = torch.zeros_like(qkv.data)  # as a reload that reallocates would
    ev = await transport.transfer(engine, target)
    assert transport.last[engine.url]["receive"][0]["plan_cached"] is False
    for name, t in served(model).items():  # landed in the new storage, not the old one
        assert torch.equal(t, ckpt[name]), name
    assert ChecksumEvidence.compare(ev.checksums or {}, ev.replica_checksums or {}).proves_equal
    await transport.transfer(engine, target)
    assert transport.last[engine.url]["receive"][0]["plan_cached"] is True
    server.worker.rolloutpool_ipc_close()
    await transport.transfer(engine, target)
    assert transport.last[engine.url]["receive"][0]["plan_cached"] is False


def test_the_block_table_covers_every_word_once_and_folds_to_the_checksums() -> None:
    """The batched kernel's table (:func:`pool.ipc_copy.block_table`) with its per-block sums
    emulated on CPU: folded per tensor, they are :mod:`pool.checksum`'s."""
    from pool.checksum import MODULUS
    from pool.ipc_copy import block_table

    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randint(-(2**15), 2**15, (n,), generator=g).to(torch.int16)
        for n in (0, 1, 16, 17, 40, 100)
    ]
    block = 16
    seg, start = block_table([t.numel() for t in tensors], block)
    assert seg == sorted(seg) and len(seg) == sum(-(-t.numel() // block) for t in tensors)
    sums = torch.zeros(len(tensors), 2, dtype=torch.int64)
    for s, at in zip(seg, start, strict=True):
        x = tensors[s][at : at + block].to(torch.int64)
        w = (torch.arange(at, at + x.numel()) % MODULUS) + 1
        sums[s] += torch.stack([x.sum(), (x * w).sum()])
    want = tensor_checksums((str(i), t) for i, t in enumerate(tensors))
    assert sums.tolist() == [[c.plain, c.weighted] for c in want.values()]


def test_the_batched_kernels_match_the_checksums_in_tritons_interpreter() -> None:
    """:mod:`pool.ipc_sums` itself, on CPU tensors, where Triton is installed (its interpreter
    must be chosen before the kernels are defined: a subprocess): both kernels pass the
    self-test the replica runs before trusting them, and the copy kernel's pieces (a bf16
    matrix, a vector, a tensor past the weights' wrap) land bit for bit with the checksums of
    :mod:`pool.checksum`."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from pool.checksum import MODULUS, tensor_checksums\n"
        "from pool.ipc_copy import _Fused, batched_kernels\n"
        "sums, copy, why = batched_kernels(torch.device('cpu'))\n"
        "assert sums is not None and copy is not None and why == '', why\n"
        "g = torch.Generator().manual_seed(2)\n"
        "src = [torch.randn(33, 70, generator=g).bfloat16(), torch.randn(5, generator=g),\n"
        "       torch.randint(-2**15, 2**15, (MODULUS + 9,), generator=g).to(torch.int16)]\n"
        "dst = [torch.zeros_like(t) for t in src]\n"
        "f = _Fused(copy, [(str(i), d, s) for i, (d, s) in enumerate(zip(dst, src))])\n"
        "got = f.collect(f.launch())\n"
        "assert all(torch.equal(d, s) for d, s in zip(dst, src))\n"
        "assert got == tensor_checksums((str(i), t) for i, t in enumerate(src)), got\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
