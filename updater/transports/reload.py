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

**Checksums** (``checksums=True``; the replicas must run RolloutPool's worker extension,
:mod:`pool.replica_extension`): the updater is the "sender". Preflight asks the replica for its
runtime layout (read-only ``rolloutpool_layout``: a replica without the extension, or whose
serving dtypes differ from the checkpoint's, is refused untouched) and computes
:func:`~pool.checkpoint.checkpoint_checksums` over the checkpoint's bytes (once per checkpoint,
outside the paused window); the transfer's evidence carries them, and validation compares them
with the replica's after the reload (:func:`updater.validation.verify_checksums`). A
checkpoint that changed between the check and the reload, a file the replica reads differently,
or a partial load is then refused: TAINTED, never published.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

from pool.checkpoint import checkpoint_checksums, safetensors_files
from pool.checksum import Checksum
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, EngineError, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from updater.transports.base import Transport, TransportSettings, WeightsTarget
from updater.transports.preflight import check_checkpoint

__all__ = ["ReloadTransport"]


@dataclass(frozen=True)
class _Sums:
    path: Path
    stats: tuple[tuple[str, int, int], ...]
    sums: dict[str, Checksum]
    seconds: float


class ReloadTransport(Transport):
    """Reload weights from disk through ``/collective_rpc``.

    ``timeout_s`` bounds the RPC (the engine loop is blocked while it runs). With
    ``verify_content_hash`` a declared ``identity.content_hash`` is checked by reading every
    weight byte once during preflight (cheap for test models, costly for large ones). With
    ``checksums`` every transfer offers the checkpoint's checksums (module docstring).
    """

    name: ClassVar[str] = "reload"

    def __init__(
        self, *, timeout_s: float = 300.0, verify_content_hash: bool = True, checksums: bool = False
    ) -> None:
        self.timeout_s = timeout_s
        self.verify_content_hash = verify_content_hash
        self.checksums = checksums
        self._sums: _Sums | None = None  # the last checkpoint's checksums

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        return cls(checksums=settings.checksums)

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Refuse ``target`` (``PreflightFailed``, with details in ``context``) unless it is
        loadable and is what its identity declares: the shared check of
        :func:`~updater.transports.preflight.check_checkpoint`. Reads local files only; the
        engine is not contacted, so it is never mutated. With checksums, also the replica's
        read-only layout call and the checkpoint's checksums (module docstring)."""
        await check_checkpoint(target, verify_content_hash=self.verify_content_hash)
        if self.checksums:
            await self._check_layout(engine, target)
            await asyncio.to_thread(self._checksums, target.path, fresh=True)

    async def _check_layout(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """The replica's runtime weights by checkpoint name must be the checkpoint's tensors
        with the same dtypes and shapes (else its checksums could never match)."""
        try:
            rpc = await engine.collective_rpc("rolloutpool_layout", timeout_s=30.0)
            layout = rpc.results[0]["layout"]
        except (EngineError, IndexError, KeyError, TypeError) as e:
            raise PreflightFailed(
                f"{engine.url} did not report its weight layout (is it running with "
                f"--worker-extension-cls pool.replica_extension.WeightExtension?): {e}",
                url=engine.url,
            ) from e
        want = {s.name: [s.dtype, list(s.shape)] for s in target.expected_manifest.tensors}
        diff = sorted(n for n in want.keys() | layout.keys() if want.get(n) != layout.get(n))
        if diff:
            raise PreflightFailed(
                f"{engine.url} serves weights that differ from the checkpoint's layout "
                f"(dtype/shape/name) at {len(diff)} names, e.g. {diff[:3]}: checksums cannot match",
                url=engine.url,
            )

    def _checksums(self, path: Path, *, fresh: bool) -> tuple[dict[str, Checksum], float]:
        """The checksums of the checkpoint at ``path`` and the seconds they took. ``fresh``
        (preflight): computed again unless the files (names, sizes, modification times) are
        those computed last. Otherwise (transfer): what preflight computed for ``path``, even if
        the files changed since, so a change after the check is caught by validation."""
        stats = tuple(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in safetensors_files(path)
        )
        last = self._sums
        if last is None or last.path != path or (fresh and last.stats != stats):
            t0 = time.monotonic()
            last = self._sums = _Sums(
                path, stats, checkpoint_checksums(path), time.monotonic() - t0
            )
        return last.sums, last.seconds

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
        sums, sums_s = (None, 0.0)
        if self.checksums:  # what preflight computed (the same checkpoint: cached)
            sums, sums_s = await asyncio.to_thread(self._checksums, path, fresh=False)
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
            checksums=sums,
            checksum_s=sums_s,
        )
