"""Marker checkpoints whose samples end at a random length: per generated token, EOS with
probability ``p`` and the marker otherwise, at temperature 1 (greedy: always the marker).

Built from :func:`rolloutpool.local.models.build_marker`'s output (``ensure_model("marker", ...)``,
so the manifest is the random models' and ``reload_weights`` swaps between any of them) by editing
two tensors, without torch:

* every token's embedding becomes the unit vector e0 (the marker recipe only sets column 0 to 1
  and leaves the rest random), so the residual stream, and after the final RMS norm the hidden
  state ``sqrt(128/(1+128*eps)) * e0`` (about 11.313), is the same for every position and token;
* ``lm_head[EOS, 0]`` is set so that ``logit(EOS) - logit(T) = ln(p / (1 - p))``; with logit T
  about 113 every other token's probability is below 1e-40, so P(EOS) = ``p`` exactly and
  output lengths are geometric (mean ``1/p``, cut at ``max_tokens``).

``config.json`` carries ``marker_eos_prob`` (vLLM ignores unknown config keys) so the stand-in
(:mod:`testkit.standin.weights`) samples the same distribution. Cached under the models' cache
root as ``eos-marker-token<T>-p<p>-<hash of this module's source and the base>``, built in a
temporary sibling and renamed into place, like :func:`rolloutpool.local.models.ensure_model`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from pool.paths import default_cache_root
from rolloutpool.local.models import EOS, HIDDEN, ensure_model, marker_token

__all__ = ["MARKERS", "eos_marker", "policy_marker"]

#: generation g serves the marker of ``g % MARKERS`` (consecutive generations differ)
MARKERS = 6
_RMS_EPS = 1e-6


def policy_marker(generation: int) -> int:
    """The marker token that generation ``generation``'s checkpoint emits."""
    return marker_token(generation % MARKERS)


def eos_marker(generation: int, eos_prob: float, cache_root: Path | None = None) -> Path:
    """The checkpoint of policy ``generation``: marker :func:`policy_marker` plus EOS with
    probability ``eos_prob`` (0 < p < 1) per sampled token. Built once, then cached."""
    if not 0.0 < eos_prob < 1.0:
        raise ValueError(f"eos_prob must be in (0, 1), got {eos_prob}")
    token = policy_marker(generation)
    base = ensure_model("marker", cache_root, token_id=token)
    code = hashlib.sha256(Path(__file__).read_bytes() + str(base).encode()).hexdigest()[:12]
    root = (cache_root or default_cache_root()).resolve()
    final = root / f"eos-marker-token{token}-p{eos_prob:.6g}-{code}"
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _build(base, tmp, token, eos_prob)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(base: Path, out: Path, token: int, p: float) -> None:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    for f in base.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    with safe_open(str(base / "model.safetensors"), "np") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(base / "model.safetensors"))
    emb = np.zeros_like(tensors["model.embed_tokens.weight"])
    emb[:, 0] = 1.0
    tensors["model.embed_tokens.weight"] = emb
    head = tensors["lm_head.weight"].copy()
    scale = 1.0 / math.sqrt(1.0 / HIDDEN + _RMS_EPS)  # e0 after the final RMS norm
    head[EOS, 0] = head[token, 0] + math.log(p / (1.0 - p)) / scale
    tensors["lm_head.weight"] = head
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
    config = json.loads((out / "config.json").read_text())
    config["marker_eos_prob"] = p
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
