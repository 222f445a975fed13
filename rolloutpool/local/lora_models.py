"""Tiny LoRA models: a base that LoRA adapters steer, and marker adapters (PEFT layout).

All are built offline and deterministically, cached by
:func:`rolloutpool.local.models.ensure_model` (kinds ``lora-base``, ``lora-marker`` and
``lora-merged``).

* :func:`build_lora_base` — the tiny Llama of :mod:`rolloutpool.local.models` (same manifest) that
  emits ``marker_token(0)`` for every prompt, and whose output one LoRA on ``o_proj`` can switch to
  any marker token. ``o_proj``/``down_proj`` are zero and every token's embedding is ``e0``, so
  without an adapter the residual stream is ``e0`` at every position and the final norm (weight 1)
  gives ``h = sqrt(128)·e0``. ``lm_head`` row ``marker_token(0)`` is ``10·e0``; the row of every
  marker token ``T`` also holds ``10·u_T``, ``u_T`` a seeded random unit vector on dims 1..127 (for
  any pair of markers ``|u_T·u_T'|`` stays below 0.5). Every other row is zero.
* :func:`build_marker_adapter` — a rank-8 LoRA on ``o_proj`` (``lora_alpha`` 8, scale 1) that
  makes the base emit ``T`` for every prompt, greedy or at temperature 1. In layer 0 the input
  of ``o_proj`` is the same vector ``c`` at every position (all embeddings are equal, so
  attention averages equal values); ``lora_A`` row 0 is ``c/|c|²`` and ``lora_B`` column 0 is
  ``20·u_T``, which adds ``20·u_T`` to the residual stream. The logit of ``T`` is then about 113
  and every other below 60. Layer 1's factors are zero.
* :func:`build_merged_marker` — that adapter merged into the base: a full checkpoint with the
  same output, for comparing adapter pushes with full-weight pushes of the same policy.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as
PEFT writes them (keys ``base_model.model.model.layers.N.self_attn.o_proj.lora_{A,B}.weight``),
so vLLM's ``/v1/load_lora_adapter`` and ``peft.PeftModel.from_pretrained`` both read it.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

from rolloutpool.local.models import (
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    MARKER_FIRST,
    MARKER_SPAN,
    VOCAB_SIZE,
    _new_model,
    _save,
    marker_token,
)

__all__ = [
    "ADAPTER_RANK",
    "ADAPTER_TARGETS",
    "build_lora_base",
    "build_marker_adapter",
    "build_merged_marker",
]

ADAPTER_RANK = 8
ADAPTER_TARGETS = ("o_proj",)
_HEAD_SCALE = 10.0
_STEER = 20.0


def _directions(seed: int) -> Any:
    """``[VOCAB_SIZE, HIDDEN]``: the unit vector ``u_T`` (dims 1..) of every marker token."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + seed)
    u = torch.zeros(VOCAB_SIZE, HIDDEN)
    rows = torch.randn(MARKER_SPAN, HIDDEN - 1, generator=gen)
    u[MARKER_FIRST : MARKER_FIRST + MARKER_SPAN, 1:] = rows / rows.norm(dim=1, keepdim=True)
    return u


def _base_model(seed: int) -> Any:
    import torch

    model = _new_model(seed, INTERMEDIATE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                p.zero_()
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, 0] = 1.0
        head = model.lm_head.weight
        head.copy_(_HEAD_SCALE * _directions(seed))
        head[marker_token(0), 0] = _HEAD_SCALE
    return model


def build_lora_base(directory: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Write the LoRA base model (recipe in the module docstring) into ``directory``."""
    return _save(_base_model(seed), directory, "float32", tokenizer_dir)


def _attention_output(model: Any) -> Any:
    """The input of layer 0's ``o_proj`` (the same at every position): ``[HIDDEN]``."""
    import torch

    seen: list[Any] = []
    o_proj = model.model.layers[0].self_attn.o_proj
    hook = o_proj.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
    finally:
        hook.remove()
    return seen[0][0, 0].clone()


def _factors(seed: int, token_id: int) -> list[tuple[Any, Any]]:
    """``(lora_A, lora_B)`` of each layer's ``o_proj`` for the marker of ``token_id``."""
    import torch

    if not MARKER_FIRST <= token_id < MARKER_FIRST + MARKER_SPAN:
        raise ValueError(
            f"marker token must be in [{MARKER_FIRST}, {MARKER_FIRST + MARKER_SPAN}), "
            f"got {token_id}"
        )
    c = _attention_output(_base_model(seed))
    if not math.isfinite(float(c.norm())) or float(c.norm()) == 0.0:
        raise ValueError("the base model's attention output is zero: no adapter can steer it")
    out = []
    for layer in range(LAYERS):
        a = torch.zeros(ADAPTER_RANK, HIDDEN)
        b = torch.zeros(HIDDEN, ADAPTER_RANK)
        if layer == 0:
            a[0] = c / c.dot(c)
            b[:, 0] = _STEER * _directions(seed)[token_id]
        out.append((a, b))
    return out


def build_merged_marker(
    directory: Path, token_id: int, *, seed: int = 0, tokenizer_dir: Path | None = None
) -> Path:
    """Write the full checkpoint of :func:`build_marker_adapter` merged into its base
    (``o_proj += B @ A``): the same marker as a full-weight push (the comparison of the LoRA
    benchmark)."""
    import torch

    model = _base_model(seed)
    with torch.no_grad():
        for layer, (a, b) in enumerate(_factors(seed, token_id)):
            model.model.layers[layer].self_attn.o_proj.weight += b @ a
    return _save(model, directory, "float32", tokenizer_dir)


def build_marker_adapter(
    directory: Path, token_id: int, *, seed: int = 0, tokenizer_dir: Path | None = None
) -> Path:
    """Write a PEFT LoRA adapter that makes the :func:`build_lora_base` of ``seed`` emit
    ``token_id`` (a marker token, 300..1999) for any prompt. ``tokenizer_dir`` is unused
    (adapters carry no tokenizer); it is accepted so the model cache can build adapters."""
    del tokenizer_dir
    tensors: dict[str, Any] = {}
    for layer, (a, b) in enumerate(_factors(seed, token_id)):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    st: Any = importlib.import_module("safetensors.torch")
    st.save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": f"rolloutpool-tiny-lora-base-seed{seed}",
        "r": ADAPTER_RANK,
        "lora_alpha": ADAPTER_RANK,
        "lora_dropout": 0.0,
        "target_modules": list(ADAPTER_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
