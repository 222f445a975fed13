"""``pool.shards`` against vLLM's own tensor-parallel layers and weight loaders (vLLM CPU 0.32,
no server): for each rank of TP=2, the layers are built as vLLM builds them for that rank (its
tensor-parallel group stood in by rank and size, nothing else faked) and filled by their own
``weight_loader`` from full checkpoint tensors; every checkpoint tensor's :class:`~pool.shards.
Piece` must then hold exactly the slice :meth:`~pool.shards.Piece.source` names, in the block
the loader wrote it to. GQA with kv heads replicated across ranks (1 kv head, TP=2) and a
vocabulary that pads are both covered. The stand-in version runs in ``tests/unit/test_shards.py``.
(Importing vLLM takes ~30 s on the shared 2-core box: hence an integration test.)"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from pool.shards import tp_pieces

pytestmark = pytest.mark.integration

H, HEAD, HEADS, FF, VOCAB = 16, 4, 4, 24, 100


def build_rank(rank: int, kv_heads: int, ck: dict[str, torch.Tensor]) -> nn.Module:
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    group = type("TP", (), {"rank_in_group": rank, "world_size": 2})()
    f32: dict[str, Any] = {"params_dtype": torch.float32}
    with set_current_vllm_config(VllmConfig()), mock.patch.object(ps, "_TP", group):
        qkv = linear.QKVParallelLinear(H, HEAD, HEADS, kv_heads, bias=True, **f32)
        o = linear.RowParallelLinear(HEADS * HEAD, H, bias=True, **f32)
        gate_up = linear.MergedColumnParallelLinear(H, [FF, FF], bias=False, **f32)
        down = linear.RowParallelLinear(FF, H, bias=False, **f32)
        embed = VocabParallelEmbedding(VOCAB, H, params_dtype=torch.float32)
        head = ParallelLMHead(VOCAB, H, params_dtype=torch.float32)
        p = "model.layers.0."
        for leaf in ("weight", "bias"):
            w = getattr(qkv, leaf)
            for x in "qkv":
                w.weight_loader(w, ck[p + f"self_attn.{x}_proj.{leaf}"], x)
        for leaf, t in (("weight", o.weight), ("bias", o.bias)):
            t.weight_loader(t, ck[p + f"self_attn.o_proj.{leaf}"])
        for i, x in enumerate(("gate", "up")):
            gate_up.weight.weight_loader(gate_up.weight, ck[p + f"mlp.{x}_proj.weight"], i)
        down.weight.weight_loader(down.weight, ck[p + "mlp.down_proj.weight"])
        embed.weight.weight_loader(embed.weight, ck["model.embed_tokens.weight"])
        head.weight.weight_loader(head.weight, ck["lm_head.weight"])
    model = nn.Module()
    model.packed_modules_mapping = {  # type: ignore[assignment]
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    inner, layer = nn.Module(), nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = qkv, o
    layer.mlp.gate_up_proj, layer.mlp.down_proj = gate_up, down
    inner.embed_tokens, inner.layers = embed, nn.ModuleList([layer])
    model.model, model.lm_head = inner, head
    return model


def checkpoint(kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    p = "model.layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, H),
        "lm_head.weight": (VOCAB, H),
        p + "self_attn.o_proj.weight": (H, HEADS * HEAD),
        p + "self_attn.o_proj.bias": (H,),
        p + "mlp.gate_proj.weight": (FF, H),
        p + "mlp.up_proj.weight": (FF, H),
        p + "mlp.down_proj.weight": (H, FF),
    }
    for x, heads in (("q", HEADS), ("k", kv_heads), ("v", kv_heads)):
        shapes[p + f"self_attn.{x}_proj.weight"] = (heads * HEAD, H)
        shapes[p + f"self_attn.{x}_proj.bias"] = (heads * HEAD,)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-sharded", "kv-replicated"])
def test_pieces_match_vllm_weight_loaders(kv_heads: int) -> None:
    ck = checkpoint(kv_heads)
    for rank in (0, 1):
        pieces = tp_pieces(build_rank(rank, kv_heads, ck), rank, 2)
        assert set(pieces) == set(ck)
        for name, piece in pieces.items():
            assert piece.shape == tuple(ck[name].shape), name
            assert piece.view.is_contiguous(), name
            assert torch.equal(piece.view, piece.source(ck[name])), (rank, name)
        assert pieces["model.layers.0.self_attn.o_proj.bias"].slice is None
        assert pieces["lm_head.weight"].slice is not None
