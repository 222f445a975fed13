"""The read-only checks of a pushed update, before a generation number is given to it.

Each raises :class:`~pool.errors.PreflightFailed` (HTTP 422 with a body naming the problem)
and changes nothing: :func:`weights_target` for a full-weight checkpoint (manifest against the
pool's, the declared identity and content hash), :func:`adapter_target` for a LoRA adapter
directory in a pool whose generations are adapters (:func:`pool.adapters.read_adapter` against
the base model's manifest, the declared content hash), :func:`check_probe` for the probe's token
ids (within the model's vocabulary).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from pool.adapters import read_adapter
from pool.checkpoint import read_manifest, vocab_size
from pool.errors import PreflightFailed
from pool.types import Manifest, WeightIdentity
from updater.api import UpdateRequest
from updater.transports.base import WeightsTarget
from updater.transports.preflight import check_provenance, check_weights

__all__ = ["adapter_target", "check_probe", "weights_target"]


def _identity(req: UpdateRequest, path: Path, manifest_digest: str) -> WeightIdentity:
    return WeightIdentity(
        manifest_digest=manifest_digest,
        checkpoint_uri=str(path),
        trainer_run=req.trainer_run,
        step=req.step,
        content_hash=req.content_hash,
    )


async def weights_target(req: UpdateRequest, path: Path, served: Manifest) -> WeightsTarget:
    """A full-weight checkpoint in ``path`` that matches the ``served`` manifest."""
    manifest = await asyncio.to_thread(read_manifest, path)
    target = WeightsTarget(_identity(req, path, manifest.digest), path, served)
    check_weights(target, manifest)
    await check_provenance(target, verify_content_hash=True)
    return target


async def adapter_target(
    req: UpdateRequest, path: Path, base: Manifest, max_rank: int
) -> WeightsTarget:
    """A LoRA adapter directory in ``path`` that fits the ``base`` model, of rank at most
    ``max_rank``; its identity's manifest digest is that of the adapter's own tensors."""
    info = await asyncio.to_thread(read_adapter, path, base, max_rank)
    target = WeightsTarget(_identity(req, path, info.manifest.digest), path, base)
    await check_provenance(target, verify_content_hash=True)
    return target


async def check_probe(model_dir: Path, req: UpdateRequest) -> None:
    """The probe's token ids lie within the vocabulary of the model in ``model_dir`` (not
    checked where its ``config.json`` names no vocabulary size)."""
    vocab = await asyncio.to_thread(vocab_size, model_dir)
    if vocab is None:
        return
    ids = req.probe.prompt_token_ids + req.probe.expected_token_ids
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        raise PreflightFailed(
            f"probe token ids {bad[:5]} are outside the model's vocabulary (0..{vocab - 1})",
            path=str(model_dir),
        )
