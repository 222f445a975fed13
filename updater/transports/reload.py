"""``reload`` transport: ``POST /collective_rpc reload_weights`` from a safetensors directory.

Works on CPU and GPU servers of vLLM 0.26-0.33 (the worker's ``reload_weights`` loads the new
checkpoint in place; ``reference/vllm-cpu.md`` §5 measured 20-40 ms for the tiny model). The
server must be able to read ``target.path`` (same host or shared filesystem).

vLLM itself validates nothing here, which is why :meth:`ReloadTransport.preflight` exists:

* a wrong-shaped checkpoint is accepted with ``{"results": [null]}`` and the server then
  produces garbage;
* a missing path fails with 500 *after* the worker started the layer-wise reload, leaving meta
  tensors: the next generation request kills the engine.

So every refusal must happen before the RPC, in :meth:`ReloadTransport.preflight` (the shared
check of :mod:`updater.transports.preflight`): the path is absolute, an existing directory with
safetensors files; its manifest (read from headers, no torch) equals the replica's manifest
recorded at bootstrap; the declared :class:`~pool.types.WeightIdentity` names this checkpoint
(manifest digest, URI, and content hash when declared). :meth:`ReloadTransport.transfer` checks
only that the directory is still there (the hazard above) and that the engine is paused.
"""

from __future__ import annotations

import time
from typing import ClassVar

from pool.checkpoint import safetensors_files
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from updater.transports.base import Transport, WeightsTarget
from updater.transports.preflight import check_checkpoint

__all__ = ["ReloadTransport"]


class ReloadTransport(Transport):
    """Reload weights from disk through ``/collective_rpc``.

    ``timeout_s`` bounds the RPC (the engine loop is blocked while it runs). With
    ``verify_content_hash`` a declared ``identity.content_hash`` is checked by reading every
    weight byte once during preflight (cheap for test models, costly for large ones).
    """

    name: ClassVar[str] = "reload"

    def __init__(self, *, timeout_s: float = 300.0, verify_content_hash: bool = True) -> None:
        self.timeout_s = timeout_s
        self.verify_content_hash = verify_content_hash

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Refuse ``target`` (``PreflightFailed``, with details in ``context``) unless it is
        loadable and is what its identity declares: the shared check of
        :func:`~updater.transports.preflight.check_checkpoint`. Reads local files only; the
        engine is not contacted, so it is never mutated."""
        await check_checkpoint(target, verify_content_hash=self.verify_content_hash)

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """``reload_weights(weights_path=...)`` on every worker of the (paused) engine.

        Before the RPC, refuses without mutation if the directory vanished
        (``PreflightFailed``) or the engine does not report itself paused (``NoMutation``).
        After it: ``{"results": [null, ...]}`` is success; an error result, a 5xx or a timeout
        raises ``AmbiguousMutation`` (a failed reload can leave meta tensors behind).
        Call :meth:`preflight` first; this method does not repeat the manifest checks.
        """
        path = target.path
        digest = target.identity.digest
        if not path.is_dir():
            raise PreflightFailed(f"checkpoint directory vanished: {path}", path=str(path))
        size = sum(f.stat().st_size for f in safetensors_files(path))
        if not await engine.is_paused():
            raise NoMutation(
                f"refusing to reload {path} into {engine.url}: the engine is not paused",
                url=engine.url,
                path=str(path),
            )
        t0 = time.monotonic()
        rpc = await engine.collective_rpc(
            "reload_weights", {"weights_path": str(path)}, timeout_s=self.timeout_s
        )
        elapsed = time.monotonic() - t0
        if not rpc.results or any(r is not None for r in rpc.results):
            raise AmbiguousMutation(
                f"reload_weights({path}) on {engine.url} reported {list(rpc.results)!r}",
                url=engine.url,
                path=str(path),
                results=list(rpc.results),
            )
        return TransferEvidence(
            transport=self.name,
            identity_digest=digest,
            ok=True,
            bytes=size,
            elapsed_s=elapsed,
            detail=f"reload_weights results={list(rpc.results)!r}",
        )
