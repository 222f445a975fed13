"""The target check every transport runs before it touches a replica, written once.

A :class:`~updater.transports.base.WeightsTarget` is refused with
:class:`~pool.errors.PreflightFailed` (details in its ``context``) unless:

1. **location** (:func:`check_location`, checkpoint targets): the path is absolute and an existing
   directory;
2. **weights** (:func:`check_weights`): the manifest of what would be loaded equals the replica's
   expected manifest — names, shapes, dtypes; the message and ``context["diff"]`` carry the
   readable differences — and the declared identity's manifest digest is that manifest's;
3. **provenance** (:func:`check_provenance`, checkpoint targets): the declared ``checkpoint_uri``
   names this path, and a declared content hash matches the files (when the transport verifies
   it: that reads every weight byte once).

:func:`check_checkpoint` runs all three on a checkpoint directory whose manifest is read from its
safetensors headers. A transport whose weights come from elsewhere (an in-process NCCL source)
runs :func:`check_weights` on its own manifest; one that reads a checkpoint its own way (NCCL
service mode) runs the three steps in this order with that manifest. Either way each check runs
once per transfer path.

Nothing here contacts an engine or mutates anything: the checks read local files only, so a
refusal leaves the replica as it was. The async functions do their blocking reads in a worker
thread; the others only look at the target and at a manifest already read.
"""

from __future__ import annotations

import asyncio

from pool.checkpoint import content_hash, read_manifest
from pool.errors import PreflightFailed
from pool.types import Manifest
from updater.transports.base import WeightsTarget

__all__ = ["check_checkpoint", "check_location", "check_provenance", "check_weights"]


def _context(target: WeightsTarget, *, path: bool) -> dict[str, str]:
    ctx = {"identity": target.identity.digest}
    if path:
        ctx["path"] = str(target.path)
    return ctx


def check_location(target: WeightsTarget) -> None:
    """Refuse a checkpoint path that is relative or not an existing directory."""
    path = target.path
    ctx = _context(target, path=True)
    if not path.is_absolute():
        raise PreflightFailed(f"checkpoint path must be absolute: {path}", **ctx)
    if not path.is_dir():
        raise PreflightFailed(f"checkpoint directory does not exist: {path}", **ctx)


def check_weights(target: WeightsTarget, manifest: Manifest, *, what: str = "checkpoint") -> None:
    """Refuse unless ``manifest`` (of the weights that would be loaded; ``what`` names them in
    the messages) is the replica's expected manifest and the identity declares its digest."""
    ctx = _context(target, path=what == "checkpoint")
    expected = target.expected_manifest
    if manifest.digest != expected.digest:
        diff = expected.diff(manifest)
        raise PreflightFailed(
            f"{what} manifest does not match the replica's model: {'; '.join(diff)}",
            diff=diff,
            expected_digest=expected.digest,
            actual_digest=manifest.digest,
            **ctx,
        )
    declared = target.identity.manifest_digest
    if declared != manifest.digest:
        raise PreflightFailed(
            f"identity mismatch: declared manifest digest {declared} != the {what}'s "
            f"{manifest.digest}",
            **ctx,
        )


async def check_provenance(target: WeightsTarget, *, verify_content_hash: bool) -> None:
    """Refuse unless the declared ``checkpoint_uri`` names ``target.path`` (as a path or a
    ``file://`` URI) and, with ``verify_content_hash``, a declared content hash matches the
    checkpoint's files (:func:`pool.checkpoint.content_hash`: one full read, in a thread)."""
    path, ident = target.path, target.identity
    ctx = _context(target, path=True)
    if ident.checkpoint_uri not in (str(path), path.as_uri()):
        raise PreflightFailed(
            f"identity mismatch: declared checkpoint_uri {ident.checkpoint_uri!r} "
            f"is not this path {str(path)!r}",
            **ctx,
        )
    if ident.content_hash is not None and verify_content_hash:
        actual = await asyncio.to_thread(content_hash, path)
        if actual != ident.content_hash:
            raise PreflightFailed(
                f"identity mismatch: declared content hash {ident.content_hash} "
                f"!= the checkpoint's {actual}",
                **ctx,
            )


async def check_checkpoint(target: WeightsTarget, *, verify_content_hash: bool) -> Manifest:
    """The whole check of a checkpoint target whose manifest is read from its safetensors
    headers (no torch, in a thread): location, weights, provenance. Returns the manifest."""
    check_location(target)
    manifest = await asyncio.to_thread(read_manifest, target.path)  # CheckpointError: a refusal
    check_weights(target, manifest)
    await check_provenance(target, verify_content_hash=verify_content_hash)
    return manifest
