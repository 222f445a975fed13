"""``pool.shards`` on CPU stand-ins of vLLM's parallel layers (class names as vLLM's, attributes
as vLLM 0.26 sets them), each rank built the way vLLM's weight loaders fill it: every
checkpoint tensor's slice must be found in the block of the parameter that holds it, the full
shapes must be the checkpoint's, and landing every slice must rebuild each rank's parameters.
The same against vLLM's own layers and loaders: ``tests/integration/test_tp_shards.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pool.shards import tp_pieces

H, HEAD, HEADS, VOCAB, PADDED, FF = 8, 2, 4, 10, 12, 12


class ColumnParallelLinear(nn.Module):
    pass


class QKVParallelLinear(ColumnParallelLinear):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class RowParallelLinear(nn.Module):
    pass


class VocabParallelEmbedding(nn.Module):
    pass


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RMSNorm(nn.Module):
    pass


class Indices:
    def __init__(self, start: int, end: int) -> None:
        self.org_vocab_start_index, self.org_vocab_end_index = start, end


def param(module: nn.Module, leaf: str, t: torch.Tensor) -> None:
    setattr(module, leaf, nn.Parameter(t.clone(), requires_grad=False))


def checkpoint(kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (VOCAB, H),
        p + "self_attn.q_proj.weight": (HEADS * HEAD, H),
        p + "self_attn.k_proj.weight": (kv_heads * HEAD, H),
        p + "self_attn.v_proj.weight": (kv_heads * HEAD, H),
        p + "self_attn.q_proj.bias": (HEADS * HEAD,),
        p + "self_attn.k_proj.bias": (kv_heads * HEAD,),
        p + "self_attn.v_proj.bias": (kv_heads * HEAD,),
        p + "self_attn.o_proj.weight": (H, HEADS * HEAD),
        p + "mlp.gate_proj.weight": (FF, H),
        p + "mlp.up_proj.weight": (FF, H),
        p + "mlp.down_proj.weight": (H, FF),
        p + "mlp.down_proj.bias": (H,),
        p + "mlp.score.weight": (FF, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (VOCAB, H),
    }
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def rank_model(ck: dict[str, torch.Tensor], rank: int, tp: int, kv_heads: int) -> nn.Module:
    """One rank of the model, filled as vLLM 0.26's loaders fill it (written out by hand)."""
    p = "model.layers.0."
    heads, kv = HEADS // tp, max(1, kv_heads // tp)
    replicas = max(1, tp // kv_heads)
    kv_block = rank // replicas

    def rows(t: torch.Tensor, block: int, n: int) -> torch.Tensor:
        return t[block * n : (block + 1) * n]

    qkv = QKVParallelLinear()
    qkv.tp_rank, qkv.tp_size = rank, tp
    qkv.head_size, qkv.num_heads, qkv.num_kv_heads = HEAD, heads, kv
    qkv.total_num_heads, qkv.total_num_kv_heads = HEADS, kv_heads
    qkv.num_kv_head_replicas = replicas
    for leaf in ("weight", "bias"):
        q = rows(ck[p + f"self_attn.q_proj.{leaf}"], rank, heads * HEAD)
        k = rows(ck[p + f"self_attn.k_proj.{leaf}"], kv_block, kv * HEAD)
        v = rows(ck[p + f"self_attn.v_proj.{leaf}"], kv_block, kv * HEAD)
        param(qkv, leaf, torch.cat([q, k, v]))
    o = RowParallelLinear()
    o.tp_rank, o.tp_size = rank, tp
    cols = HEADS * HEAD // tp
    param(o, "weight", ck[p + "self_attn.o_proj.weight"][:, rank * cols : (rank + 1) * cols])
    gate_up = MergedColumnParallelLinear()
    gate_up.tp_rank, gate_up.tp_size, gate_up.output_sizes = rank, tp, [FF, FF]
    n = FF // tp
    param(
        gate_up,
        "weight",
        torch.cat([rows(ck[p + f"mlp.{x}_proj.weight"], rank, n) for x in ("gate", "up")]),
    )
    down = RowParallelLinear()
    down.tp_rank, down.tp_size = rank, tp
    param(down, "weight", ck[p + "mlp.down_proj.weight"][:, rank * n : (rank + 1) * n])
    param(down, "bias", ck[p + "mlp.down_proj.bias"])  # not sharded
    score = ColumnParallelLinear()  # a plain column-parallel layer
    score.tp_rank, score.tp_size = rank, tp
    param(score, "weight", rows(ck[p + "mlp.score.weight"], rank, n))
    shard = PADDED // tp  # the padded vocabulary, split evenly; the last rank holds padding
    start, end = min(rank * shard, VOCAB), min((rank + 1) * shard, VOCAB)

    def vocab(cls: type[nn.Module], t: torch.Tensor) -> nn.Module:
        m = cls()
        m.shard_indices, m.org_vocab_size = Indices(start, end), VOCAB
        padded = torch.zeros(shard, H)
        padded[: end - start] = t[start:end]
        param(m, "weight", padded)
        return m

    model = nn.Module()
    model.packed_modules_mapping = {  # type: ignore[assignment]
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    inner, layer = nn.Module(), nn.Module()
    inner.embed_tokens = vocab(VocabParallelEmbedding, ck["model.embed_tokens.weight"])
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.self_attn.o_proj = qkv, o
    layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.score = gate_up, down, score
    inner.layers = nn.ModuleList([layer])
    inner.norm = RMSNorm()
    param(inner.norm, "weight", ck["model.norm.weight"])
    model.model = inner
    model.lm_head = vocab(ParallelLMHead, ck["lm_head.weight"])
    return model


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["kv-sharded", "kv-replicated"])
def test_every_rank_finds_its_slices_and_landing_them_rebuilds_it(kv_heads: int) -> None:
    ck = checkpoint(kv_heads)
    for rank in (0, 1):
        model = rank_model(ck, rank, 2, kv_heads)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        pieces = tp_pieces(model, rank, 2)
        assert set(pieces) == set(ck)
        for name, piece in pieces.items():
            assert piece.shape == tuple(ck[name].shape) and piece.dtype == "float32", name
            assert piece.view.is_contiguous(), name
            assert torch.equal(piece.view, piece.source(ck[name])), name
        assert pieces["model.norm.weight"].slice is None
        assert pieces["model.layers.0.mlp.down_proj.bias"].slice is None
        assert pieces["model.layers.0.mlp.down_proj.weight"].slice == (1, rank * 6, 6)
        for p in model.parameters():
            p.data.fill_(7.0)  # the padding rows of the vocabulary keep this
        for name, piece in pieces.items():
            piece.view.copy_(piece.source(ck[name]))
        for n, p in model.named_parameters():
            if n.endswith(("embed_tokens.weight", "lm_head.weight")):
                used = pieces["lm_head.weight" if "lm_head" in n else "model.embed_tokens.weight"]
                rows = used.view.shape[0]
                assert torch.equal(p[:rows], before[n][:rows]), n
            else:
                assert torch.equal(p, before[n]), n


def test_fused_parts_that_do_not_add_up_are_refused() -> None:
    ck = checkpoint(4)
    model = rank_model(ck, 0, 2, 4)
    model.model.layers[0].mlp.gate_up_proj.output_sizes = [FF, FF + 2]
    with pytest.raises(RuntimeError, match="rows"):
        tp_pieces(model, 0, 2)
