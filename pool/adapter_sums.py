"""The checksums a LoRA adapter must have once vLLM loaded it, computed from its directory
(numpy, no torch), to compare with what the replica's workers report
(:meth:`pool.replica_extension.WeightExtension.rolloutpool_lora_checksums`).

vLLM holds each factor of a loaded adapter in the served dtype, with the adapter's scaling
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) multiplied into ``lora_B``: the
stored tensor is cast to the served dtype, then multiplied by the scaling (as float32, in
float32, rounded back to the dtype to nearest even), as torch does on every device. This module
does the same to the stored bytes, so equal :mod:`pool.checksum` values mean that the factors the
replica computes with are exactly the directory's. Names are a factor's module and ``.lora_A``
or ``.lora_B`` (``base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight`` ->
``model.layers.0.self_attn.o_proj.lora_B``).

Served dtypes float32, float16 and bfloat16 from stored float32, float16 or bfloat16; anything
else, and an adapter whose config has a ``rank_pattern`` or an ``alpha_pattern`` (a scaling per
module), raises :class:`NotComparable`: its checksums cannot be predicted here.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

from pool.adapters import ADAPTER_CONFIG, LORA_FACTOR
from pool.checkpoint import tensor_bytes
from pool.checksum import Checksum, words_checksum
from pool.errors import RolloutPoolError

__all__ = ["NotComparable", "expected_adapter_checksums"]

_FLOATS = frozenset({"float32", "float16", "bfloat16"})


class NotComparable(RolloutPoolError, code="not_comparable"):
    """The adapter's loaded checksums cannot be predicted from its directory."""


def _np() -> Any:
    return importlib.import_module("numpy")


def _scaling(config: dict[str, Any]) -> float:
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise NotComparable("the adapter scales its modules differently (rank/alpha pattern)")
    rank = float(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _as_float32(np: Any, data: Any, dtype: str) -> Any:
    """The stored values as float32 (exact: every source dtype fits)."""
    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")
    return np.frombuffer(data, dtype="<f4" if dtype == "float32" else "<f2").astype("<f4")


def _round(np: Any, values: Any, dtype: str) -> Any:
    """float32 ``values`` rounded to ``dtype`` (to nearest even, as torch), as that dtype's
    little-endian bytes-like array (bfloat16 as its 16-bit patterns)."""
    if dtype == "float32":
        return values.astype("<f4")
    if dtype == "float16":
        return values.astype("<f2")
    bits = values.astype("<f4").view("<u4")
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    out[np.isnan(values)] = 0x7FC0  # torch's bfloat16 NaN
    return out


def expected_adapter_checksums(path: Path, dtype: str) -> dict[str, Checksum]:
    """The checksums of every factor of the adapter in ``path`` as a replica serving ``dtype``
    holds it (see the module docstring). Reads the whole adapter (small: rank x dims per
    module). Raises :class:`NotComparable` (see above) and
    :class:`~pool.checkpoint.CheckpointError` for an unreadable adapter."""
    if dtype not in _FLOATS:
        raise NotComparable(f"served dtype {dtype} (float32, float16 or bfloat16 only)")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    scaling = _scaling(config)
    np = _np()
    out: dict[str, Checksum] = {}
    for spec, data in tensor_bytes(path):
        m = LORA_FACTOR.match(spec.name)
        if m is None:
            raise NotComparable(f"tensor {spec.name!r} is not a LoRA factor")
        if spec.dtype not in _FLOATS:
            raise NotComparable(f"{spec.name}: stored as {spec.dtype}")
        served = _round(np, _as_float32(np, data, spec.dtype), dtype)
        if m["ab"] == "B" and scaling != 1.0:
            scaled = _as_float32(np, served.tobytes(), dtype) * np.float32(scaling)
            served = _round(np, scaled, dtype)
        plain, weighted = words_checksum(served.tobytes(), 2)
        out[f"{m['module']}.lora_{m['ab']}"] = Checksum(dtype, spec.shape, plain, weighted)
    return out
