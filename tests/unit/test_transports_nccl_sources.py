"""``updater.transports.nccl.sources``: what a source declares (no torch: the tensors are stand-ins
with a shape and a dtype, the checkpoint a header with zero bytes behind it)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pool.checkpoint import read_manifest
from pool.types import TensorSpec
from updater.transports.nccl import CheckpointSource, ModuleSource, SourceSpec, WeightSource
from updater.transports.nccl.sources import SourceSlot


def test_module_source_reads_named_parameters() -> None:
    class T:
        def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
            self.shape, self.dtype, self.detached = shape, dtype, False

        def detach(self) -> T:
            self.detached = True
            return self

    params = [("a.weight", T((4, 2), "torch.bfloat16")), ("b.bias", T((4,), "torch.float32"))]

    class Module:
        def named_parameters(self) -> list[tuple[str, T]]:
            return params

    src = ModuleSource(Module())
    assert src.specs() == [
        TensorSpec(name="a.weight", shape=(4, 2), dtype="bfloat16"),
        TensorSpec(name="b.bias", shape=(4,), dtype="float32"),
    ]
    assert src.nbytes() == 4 * 2 * 2 + 4 * 4
    assert [n for n, t in src if t.detached] == ["a.weight", "b.bias"]
    assert ModuleSource(lambda: params).specs() == src.specs()
    with pytest.raises(TypeError):
        ModuleSource(42)


def write_safetensors(path: Path, tensors: list[tuple[str, str, list[int]]]) -> None:
    """A minimal safetensors file (header + zero bytes), in the given order, no torch needed."""
    header: dict[str, Any] = {}
    off = 0
    for name, dtype, shape in tensors:
        n = 2 * max(1, math.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(dict(sorted(header.items()))).encode()  # JSON order != data order
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(off))


def test_checkpoint_source_sends_in_file_order_and_rebuilds_from_its_spec(tmp_path: Path) -> None:
    tensors = [
        ("model.embed_tokens.weight", "BF16", [64, 8]),
        ("model.layers.0.self_attn.q_proj.weight", "BF16", [8, 8]),
        ("model.norm.weight", "BF16", [8]),
    ]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    src = CheckpointSource(tmp_path)
    assert [s.name for s in src.specs()] == [n for n, _, _ in tensors]  # data order, not JSON's
    assert src.manifest() == read_manifest(tmp_path)
    assert src.nbytes() == (64 * 8 + 8 * 8 + 8) * 2
    spec = src.spec()
    assert spec == SourceSpec(
        "updater.transports.nccl.sources:CheckpointSource",
        (("path", str(tmp_path)), ("device", "cuda:0")),
    )
    rebuilt = spec.build()
    assert isinstance(rebuilt, CheckpointSource) and rebuilt.specs() == src.specs()


def test_source_spec_refuses_what_is_not_a_source() -> None:
    with pytest.raises(TypeError, match="not a WeightSource"):
        SourceSpec("pool.types:Manifest", (("tensors", ()),)).build()
    with pytest.raises(ModuleNotFoundError):
        SourceSpec("no_such_module_here:X").build()


class Tracked(WeightSource):
    """Counts its releases."""

    def __init__(self) -> None:
        self.released = 0

    def specs(self) -> list[TensorSpec]:
        return []

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    def release(self) -> None:
        self.released += 1


def test_a_source_slot_holds_one_source_and_releases_it_for_another() -> None:
    def never() -> WeightSource:
        raise AssertionError("the held source is not built again")

    def broken() -> WeightSource:
        raise RuntimeError("cannot build")

    slot: SourceSlot[str] = SourceSlot()
    a = slot.get("a", Tracked)
    assert slot.get("a", never) is a
    b = slot.get("b", Tracked)
    assert isinstance(a, Tracked) and isinstance(b, Tracked)
    assert (a.released, b.released) == (1, 0)  # one checkpoint on the GPU at a time
    with pytest.raises(RuntimeError):
        slot.get("c", broken)
    assert b.released == 1
    assert slot.get("b", Tracked) is not b  # a failed build leaves the slot empty


def test_staged_source_is_a_copy_the_trainer_may_overwrite_at_once() -> None:
    """Pins staging mode (#15.3): after ``stage`` returns, changing the trainer's weights does
    not change what is sent; staging again reuses the buffers (no allocation per update)."""
    import torch

    from updater.transports.nccl import StagedSource

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    staged = StagedSource()
    assert staged.stage(model) >= 0
    sent = {n: t.clone() for n, t in staged}
    assert [s.name for s in staged.specs()] == [n for n, _ in model.named_parameters()]
    buffers = [t.data_ptr() for _, t in staged]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the trainer trains on
    assert all(torch.equal(t, sent[n]) for n, t in staged)
    staged.stage(model)
    assert [t.data_ptr() for _, t in staged] == buffers
    assert all(torch.equal(t, p) for (_, t), p in zip(staged, model.parameters(), strict=True))
    staged.release()
    assert staged.specs() == [] and list(staged) == []
