"""``pool.replica_extension`` on a CPU stand-in of a vLLM model: the runtime-to-checkpoint
mapping (fused q/k/v and gate/up row blocks, a padded vocabulary, a CPU-repacked linear weight
recovered through the identity) and the RPC methods as vLLM's worker would expose them. The
real thing (vLLM CPU 0.32 with ``--worker-extension-cls``) is in
``tests/integration/test_checksum_validation.py``; the GPU receive in ``bench/gpu_update.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from pool.checksum import from_json, tensor_checksums
from pool.replica_extension import WeightExtension, runtime_views

H, Q, KV, FF, VOCAB, PADDED = 8, 8, 4, 12, 10, 16


class Fused(nn.Module):
    def __init__(self, weight: torch.Tensor, sizes: list[int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.output_sizes = sizes


class Repacked(nn.Module):
    """vLLM CPU after ``dispatch_cpu_unquantized_gemm(remove_weight=True)``: an empty weight and
    a ``cpu_linear`` holding the real one in another layout."""

    def __init__(self, weight: torch.Tensor, sizes: list[int]) -> None:
        super().__init__()
        hidden = weight.t().contiguous()  # the 'packed' copy
        self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        self.output_sizes = sizes
        self.input_size_per_partition = weight.shape[1]
        self.cpu_linear = lambda x, w, b: x @ hidden


class Embedding(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        padded = torch.zeros(PADDED, weight.shape[1], dtype=weight.dtype)
        padded[:VOCAB] = weight
        self.weight = nn.Parameter(padded, requires_grad=False)
        self.org_vocab_size = VOCAB


def checkpoint(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, H),
        "model.layers.0.self_attn.q_proj.weight": (Q, H),
        "model.layers.0.self_attn.k_proj.weight": (KV, H),
        "model.layers.0.self_attn.v_proj.weight": (KV, H),
        "model.layers.0.mlp.gate_proj.weight": (FF, H),
        "model.layers.0.mlp.up_proj.weight": (FF, H),
        "model.norm.weight": (H,),
    }
    return {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}


def runtime(ckpt: dict[str, torch.Tensor], *, repacked: bool) -> nn.Module:
    p = "model.layers.0."
    qkv = torch.cat([ckpt[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([ckpt[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
    model = nn.Module()
    model.packed_modules_mapping = {  # type: ignore[assignment]
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    inner = nn.Module()
    inner.embed_tokens = Embedding(ckpt["model.embed_tokens.weight"])
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = Fused(qkv, [Q, KV, KV])
    layer.mlp = nn.Module()
    gate_up_cls = Repacked if repacked else Fused
    layer.mlp.gate_up_proj = gate_up_cls(gate_up, [FF, FF])
    inner.layers = nn.ModuleList([layer])
    inner.norm = nn.Module()
    inner.norm.weight = nn.Parameter(ckpt["model.norm.weight"].clone(), requires_grad=False)
    model.model = inner
    return model


@pytest.mark.parametrize("repacked", [False, True], ids=["gpu-like", "cpu-repacked"])
def test_runtime_views_are_the_checkpoint_tensors(repacked: bool) -> None:
    ckpt = checkpoint()
    views = runtime_views(runtime(ckpt, repacked=repacked), writable=False)
    assert set(views) == set(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(views[name], t), name
    assert tensor_checksums(views.items()) == tensor_checksums(ckpt.items())


def test_writable_views_alias_the_runtime_parameters() -> None:
    ckpt = checkpoint(torch.bfloat16)
    model = runtime(ckpt, repacked=False)
    views = runtime_views(model, writable=True)
    views["model.layers.0.self_attn.k_proj.weight"].fill_(1.0)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.all(qkv[Q : Q + KV] == 1.0)
    assert torch.equal(qkv[:Q], ckpt["model.layers.0.self_attn.q_proj.weight"])
    assert all(v.is_contiguous() for v in views.values())
    with pytest.raises(RuntimeError, match="repacked"):
        runtime_views(runtime(ckpt, repacked=True), writable=True)


class FakeRunner:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def get_model(self) -> nn.Module:
        return self.model


class FakeWorker:
    """What the extension needs from vLLM's worker: ``model_runner`` and the parallel sizes."""

    def __init__(self, model: nn.Module, tp: int = 1) -> None:
        self.model_runner = FakeRunner(model)
        self.parallel_config = type("P", (), {"tensor_parallel_size": tp})()


def worker_class() -> type[Any]:
    """vLLM's injection (``worker_base.py``): the extension's names must not clash with the
    worker's; then it is appended to the worker's bases."""
    clash = [a for a in dir(WeightExtension) if not a.startswith("__") and hasattr(FakeWorker, a)]
    assert clash == []
    return type("Worker", (FakeWorker, WeightExtension), {})


def test_rpc_methods_answer_json_per_checkpoint_name() -> None:
    ckpt = checkpoint()
    worker = worker_class()(runtime(ckpt, repacked=True))
    layout = json.loads(json.dumps(worker.rolloutpool_layout()))
    assert layout["layout"]["model.layers.0.mlp.up_proj.weight"] == ["float32", [FF, H]]
    assert layout["device"] == "cpu"
    got = json.loads(json.dumps(worker.rolloutpool_checksums()))
    assert from_json(got["checksums"]) == tensor_checksums(ckpt.items())
    assert got["elapsed_s"] >= 0
    with pytest.raises(RuntimeError, match="direct_init first"):
        worker.rolloutpool_direct_receive(json.dumps("127.0.0.1:1"), json.dumps([]))
    assert worker.rolloutpool_direct_close() == {"closed": []}
    sharded = worker_class()(runtime(ckpt, repacked=True), tp=2)
    with pytest.raises(RuntimeError, match="TP=2"):
        sharded.rolloutpool_checksums()
