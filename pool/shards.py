"""Where each checkpoint tensor lives on one tensor-parallel rank of a vLLM model (TP > 1).

vLLM shards a layer's parameters by the layer's kind (0.26, ``model_executor/layers``); this
module reproduces where each *checkpoint* tensor's shard lands, so a sender can broadcast the
full tensor and every rank copy its own slice (:meth:`Piece.source`) straight into the runtime
parameter, and both sides checksum the same shard:

* column-parallel (``ColumnParallelLinear``): rows ``[r*s, (r+1)*s)`` of the output dimension,
  ``s`` = the rank's rows; a bias the same way;
* ``MergedColumnParallelLinear`` (gate/up fused): part ``i`` of the fused parameter holds rows
  ``[r*s_i, (r+1)*s_i)`` of checkpoint tensor ``i``, ``s_i = output_sizes[i] / tp``;
* ``QKVParallelLinear``: q rows ``[r*q, (r+1)*q)`` (``q`` = the rank's heads x head size); k and
  v rows of kv-head block ``r // num_kv_head_replicas`` (kv heads are replicated when TP exceeds
  their number);
* row-parallel (``RowParallelLinear``): the weight's columns ``[r*s, (r+1)*s)`` (input
  dimension); its bias is whole on every rank;
* vocab-parallel (``VocabParallelEmbedding``, ``ParallelLMHead``): vocabulary rows
  ``[org_vocab_start_index, org_vocab_end_index)`` land in the first rows of the rank's padded
  parameter (the padding rows hold nothing sent);
* anything else (norms, ``ReplicatedLinear``): the whole tensor on every rank.

Layer kinds are recognised by class name along the MRO (no vLLM import here; the unit tests use
stand-ins, ``tests/integration/test_tp_shards.py`` checks the result against vLLM's own weight
loaders). A layer's own ``tp_rank`` / ``tp_size`` win over the model's (vLLM's ``disable_tp``).
A parameter of an unknown sharded kind is reported at its local shape, which a sender's
preflight refuses against the checkpoint's (fail closed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Piece", "tp_pieces"]


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor on one rank: its full ``shape`` and ``dtype`` (what is sent),
    ``slice`` = ``(dim, start, length)`` of it this rank holds (None: all of it), and ``view``,
    the contiguous block of the runtime parameter it lands in."""

    shape: tuple[int, ...]
    dtype: str
    view: Any
    slice: tuple[int, int, int] | None

    def source(self, full: Any) -> Any:
        """The part of the full tensor ``full`` this rank holds (a view, maybe not contiguous)."""
        return full if self.slice is None else full.narrow(*self.slice)


def _dtype(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _kinds(module: Any) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _blocks(
    t: Any,
    names: list[str],
    sizes: list[int],
    fulls: list[int],
    starts: list[int],
    where: str,
) -> dict[str, Piece]:
    """Row blocks of a fused parameter: block ``i`` (``sizes[i]`` rows) is rows
    ``[starts[i], starts[i] + sizes[i])`` of checkpoint tensor ``names[i]`` (``fulls[i]`` rows)."""
    if sum(sizes) != t.shape[0]:
        raise RuntimeError(f"{where}: rows {t.shape[0]} != sum{sizes}")
    out: dict[str, Piece] = {}
    offset = 0
    for name, size, full, start in zip(names, sizes, fulls, starts, strict=True):
        view = t[offset : offset + size]
        out[name] = Piece((full, *t.shape[1:]), _dtype(t), view, (0, start, size))
        offset += size
    return out


def tp_pieces(model: Any, tp_rank: int, tp_size: int) -> dict[str, Piece]:
    """Every checkpoint tensor of ``model`` (this rank's copy) as a :class:`Piece`, by name.
    Raises ``RuntimeError`` where a fused parameter's parts do not add up."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules: dict[str, Any] = dict(model.named_modules())
    out: dict[str, Piece] = {}
    for pname, param in model.named_parameters():
        mod_name, _, leaf = pname.rpartition(".")
        module: Any = modules.get(mod_name)
        kinds = _kinds(module)
        t = param.data
        parent, _, short = mod_name.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" if parent else f"{p}.{leaf}" for p in packed.get(short, [])]
        rank = int(getattr(module, "tp_rank", tp_rank))
        size = int(getattr(module, "tp_size", tp_size))
        if leaf not in ("weight", "bias"):
            out[pname] = Piece(tuple(t.shape), _dtype(t), t, None)
        elif "QKVParallelLinear" in kinds and len(parts) == 3:
            hs = int(module.head_size)
            vhs = int(getattr(module, "v_head_size", hs))
            nh, nkv = int(module.num_heads), int(module.num_kv_heads)
            kv_block = rank // int(getattr(module, "num_kv_head_replicas", 1))
            sizes = [nh * hs, nkv * hs, nkv * vhs]
            total_kv = int(module.total_num_kv_heads)
            fulls = [int(module.total_num_heads) * hs, total_kv * hs, total_kv * vhs]
            starts = [rank * sizes[0], kv_block * sizes[1], kv_block * sizes[2]]
            out.update(_blocks(t, parts, sizes, fulls, starts, pname))
        elif "MergedColumnParallelLinear" in kinds and len(parts) == len(module.output_sizes):
            fulls = [int(s) for s in module.output_sizes]
            sizes = [s // size for s in fulls]
            out.update(_blocks(t, parts, sizes, fulls, [rank * s for s in sizes], pname))
        elif "ColumnParallelLinear" in kinds:
            rows = int(t.shape[0])
            out[pname] = Piece((rows * size, *t.shape[1:]), _dtype(t), t, (0, rank * rows, rows))
        elif "RowParallelLinear" in kinds and leaf == "weight":
            cols = int(t.shape[1])
            shape = (int(t.shape[0]), cols * size, *t.shape[2:])
            out[pname] = Piece(shape, _dtype(t), t, (1, rank * cols, cols))
        elif "VocabParallelEmbedding" in kinds and leaf == "weight":
            idx = module.shard_indices
            start = int(idx.org_vocab_start_index)
            n = int(idx.org_vocab_end_index) - start
            shape = (int(module.org_vocab_size), *t.shape[1:])
            out[pname] = Piece(shape, _dtype(t), t[:n], (0, start, n))
        else:
            out[pname] = Piece(tuple(t.shape), _dtype(t), t, None)
    return out
