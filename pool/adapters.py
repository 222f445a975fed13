"""LoRA generations: adapter names and the preflight of a PEFT adapter directory. No I/O beyond
reading the adapter's two files; no torch.

In a pool whose generations are adapters (``generations: lora``) the base model is fixed and
generation ``g >= 1`` is a LoRA adapter served under :func:`adapter_name`; generation 0 is the
base model itself. Every replica serves several adapters side by side, and a request names its
adapter in ``model`` (the router writes it from the rollout's binding), so a rollout bound to g
runs on g however many newer adapters were loaded beside it.

:func:`read_adapter` checks an adapter directory before anything is loaded anywhere. The PEFT
layout is ``adapter_config.json`` plus ``adapter_model.safetensors`` whose tensors are named
``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and ``...lora_B.weight``
(``[out_features, r]``). Refused, each with a :class:`~pool.errors.PreflightFailed` naming the
problem: a missing or unreadable file, a file outside the directory (the confinement of
:mod:`pool.checkpoint`), ``peft_type`` other than ``LORA``, a rank above the replicas'
``max_lora_rank``, DoRA, biases or ``modules_to_save`` (vLLM serves none of them), a target
module that is not a linear module of the base model, a tensor that is not a LoRA factor of
such a module, and factors whose shapes do not fit the base module. vLLM 0.32 loads an adapter
whose ``lora_A`` is narrower than its module without complaint and serves garbage from it
(observed on CPU), so the shape check is the only guard against that.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.checkpoint import CheckpointError, read_manifest
from pool.errors import PreflightFailed
from pool.types import Generation, Manifest

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LORA_FACTOR",
    "AdapterInfo",
    "adapter_name",
    "read_adapter",
    "served_model",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: A PEFT factor tensor's name: its module and which factor ("A" or "B").
LORA_FACTOR = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)


def adapter_name(generation: Generation) -> str | None:
    """The name generation ``g`` is served under on every replica: ``rp-<number>-<label>``
    (unique: numbers are); None for generation 0, the base model."""
    if generation.number == 0:
        return None
    return f"rp-{generation.number}-{generation.label}"


def served_model(generation: Generation, base_model: str) -> str:
    """What a request of ``generation`` puts in ``model``: its adapter, or ``base_model``."""
    return adapter_name(generation) or base_model


@dataclass(frozen=True)
class AdapterInfo:
    """An adapter directory that passed :func:`read_adapter`. ``manifest`` lists its factor
    tensors (its digest is the identity's ``manifest_digest``); ``modules`` the base modules it
    changes; ``base_model`` what its config says it was trained on (informational)."""

    rank: int
    alpha: float
    modules: tuple[str, ...]
    manifest: Manifest
    base_model: str


def _refuse(path: Path, msg: str) -> PreflightFailed:
    return PreflightFailed(f"adapter {path}: {msg}", path=str(path))


def _config(path: Path) -> dict[str, Any]:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise _refuse(path, f"no {ADAPTER_CONFIG} (a PEFT adapter directory has one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise _refuse(path, f"unreadable {ADAPTER_CONFIG}: {type(e).__name__}") from e
    if not isinstance(config, dict):
        raise _refuse(path, f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _check_config(path: Path, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type is {config.get('peft_type')!r}, only LORA is served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _refuse(path, f"rank {rank} is above the replicas' max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(path, f"'lora_alpha' must be a number, got {alpha!r}")
    for flag in ("use_dora", "lora_bias"):
        if config.get(flag):
            raise _refuse(path, f"{flag} is set: vLLM does not serve it")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias {config.get('bias')!r}: vLLM serves only bias 'none'")
    if config.get("modules_to_save"):
        raise _refuse(path, "modules_to_save is set: vLLM does not serve it")
    return rank, float(alpha)


def read_adapter(path: Path, base: Manifest, max_rank: int) -> AdapterInfo:
    """Check the adapter in ``path`` against the ``base`` model's manifest (see the module
    docstring for what is refused). Reads only the config and the safetensors header."""
    config = _config(path)
    rank, alpha = _check_config(path, config, max_rank)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise _refuse(path, f"no {ADAPTER_WEIGHTS}")
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        raise _refuse(path, str(e)) from e
    shapes = {t.name: t.shape for t in base.tensors}
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in manifest.tensors:
        m = LORA_FACTOR.match(t.name)
        if m is None:
            raise _refuse(path, f"tensor {t.name!r} is not a LoRA factor (lora_A/lora_B)")
        factors.setdefault(m["module"], {})[m["ab"]] = t.shape
    if not factors:
        raise _refuse(path, "no LoRA factor tensors")
    for module, ab in sorted(factors.items()):
        weight = shapes.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            raise _refuse(path, f"{module} is not a linear module of the base model")
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"{module} has lora_{''.join(ab)} but not both factors")
        out_f, in_f = weight
        if ab["A"] != (rank, in_f) or ab["B"] != (out_f, rank):
            raise _refuse(
                path,
                f"{module}: lora_A {list(ab['A'])} / lora_B {list(ab['B'])} do not fit the "
                f"base module {list(weight)} at rank {rank} (expected [{rank}, {in_f}] / "
                f"[{out_f}, {rank}])",
            )
    base_model = config.get("base_model_name_or_path")
    return AdapterInfo(
        rank=rank,
        alpha=alpha,
        modules=tuple(sorted(factors)),
        manifest=manifest,
        base_model=base_model if isinstance(base_model, str) else "",
    )
