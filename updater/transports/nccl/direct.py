"""``nccl_direct``: broadcast each tensor straight into the replica's runtime parameters.

vLLM 0.26's own receive path (the ``nccl`` transport) loads every chunk through its layerwise
reload (Python per tensor, fresh tensors per layer, copies back into the kernel storage): on the
GPU host that, not the wire, bounds the transfer (``bench/results/gpu_update.json``). This path
keeps vLLM unmodified and uses its supported plug-in point instead: the replica runs RolloutPool's
worker extension (``--worker-extension-cls pool.replica_extension.WeightExtension``), which joins
an NCCL group of its own with the sender and receives each checkpoint tensor by one broadcast
into a view of the runtime parameter (the row block of a fused ``qkv_proj`` / ``gate_up_proj``),
so the data lands where the kernels read it. Per transfer there is one HTTP call (a
``/collective_rpc``), no start/finish, no staging buffer on either side.

**Protocol** (all calls through the replica's one control client, :mod:`.control`):

1. preflight: :class:`~updater.transports.nccl.NcclTransport`'s checks, plus the replica's
   layout (``rolloutpool_layout``, read-only): every tensor to send must have a runtime view
   of the same dtype and shape, else :class:`~pool.errors.PreflightFailed` (a replica without
   the extension is refused here, untouched);
2. group (once per replica, like ``nccl``): ``rolloutpool_direct_init`` on the server,
   concurrently with the sender joining as rank 0 (vLLM's ``StatelessProcessGroup`` +
   ``PyNcclCommunicator``);
3. transfer: ``rolloutpool_direct_receive(names)`` on the server, concurrently with the
   sender's broadcasts (:meth:`~updater.transports.nccl.senders.SenderCore.direct_send`).
   Both sides checksum every tensor on a second stream while the data moves (the sender what
   it was given, the replica each runtime view right after its data landed); the evidence
   carries both and the cycle runner compares them in VALIDATING (no second call to the
   replica in the paused window).

Failure classes, deadlines, abandoned groups and ports are those of the ``nccl`` transport
(:mod:`.transport`): anything after the receive began is ambiguous. vLLM's own path stays the
fallback (``nccl``), e.g. for versions or models the extension cannot map (TP > 1).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from pool.checksum import Checksum, from_json
from pool.engine import VllmEngine
from pool.errors import PreflightFailed
from pool.types import TensorSpec
from updater.transports.base import WeightsTarget
from updater.transports.nccl.config import Packing
from updater.transports.nccl.control import HttpStepError
from updater.transports.nccl.senders import Rendezvous, WireSource
from updater.transports.nccl.transport import NcclTransport, _gather_threads, _Group, _spawn
from updater.transports.nccl.versions import ApiFamily

__all__ = ["NcclDirectTransport"]


class NcclDirectTransport(NcclTransport):
    """The ``nccl`` transport's groups, checks and failure handling, with the direct receive of
    the module docstring. Constructed like :class:`NcclTransport` (in process with a
    ``source``, or service mode); ``self.packing`` is not used (one broadcast per tensor)."""

    name: ClassVar[str] = "nccl_direct"

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """:meth:`NcclTransport.preflight`, then the replica's runtime layout against what
        would be sent (read-only ``rolloutpool_layout``)."""
        await super().preflight(engine, target)
        checked = self._checked[engine.url.rstrip("/")]
        await self._check_layout(engine.url, list(checked.specs))

    async def _check_layout(self, url: str, specs: list[TensorSpec]) -> None:
        client = self._client(url)
        try:
            results = await asyncio.wrap_future(
                _spawn(
                    client.collective_rpc,
                    "rolloutpool_layout",
                    {},
                    self.config.control_timeout_s,
                    name="nccl-direct-layout",
                )
            )
            layout: dict[str, Any] = results[0]["layout"]
        except (HttpStepError, IndexError, KeyError, TypeError) as e:
            raise PreflightFailed(
                f"{url} did not report its weight layout (is it running with "
                f"--worker-extension-cls pool.replica_extension.WeightExtension?): {e}",
                url=url,
            ) from e
        bad = [s.name for s in specs if layout.get(s.name) != [s.dtype, list(s.shape)]]
        if bad:
            raise PreflightFailed(
                f"{url}: {len(bad)} tensors have no runtime view of the same dtype and shape, "
                f"e.g. {bad[:3]} (runtime: {[layout.get(n) for n in bad[:3]]})",
                url=url,
            )

    def _plan(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The tensors put on the wire, in order: all of them. (The sender checksums every
        tensor of the source whatever this returns, so a plan that loses tensors is caught by
        validation: the negative control of ``bench/gpu_update.py`` overrides this.)"""
        return specs

    async def _init_group(
        self, url: str, at: Rendezvous, family: ApiFamily, packing: Packing
    ) -> None:
        kwargs = {
            "master_address": at.address,
            "master_port": at.port,
            "world_size": at.world_size,
            "rank_offset": 1,
        }
        client = self._client(url)
        await _gather_threads(
            _spawn(
                client.collective_rpc,
                "rolloutpool_direct_init",
                kwargs,
                self.config.init_timeout_s,
                name=f"nccl-direct-init-http-{at.key}",
            ),
            _spawn(self.sender.direct_init, at, name=f"nccl-direct-init-{at.key}"),
        )

    async def _send(
        self,
        url: str,
        g: _Group,
        wire: WireSource,
        specs: list[TensorSpec],
        packing: Packing,
        timings: dict[str, Any],
    ) -> tuple[dict[str, Checksum], dict[str, Checksum] | None]:
        plan = self._plan(specs)
        names = [[s.name, s.dtype, list(s.shape)] for s in plan]
        client = self._client(url)
        timings["step"] = "receive"
        received, sent = await _gather_threads(
            _spawn(
                client.collective_rpc,
                "rolloutpool_direct_receive",
                {
                    "group": f"{self.config.master_address}:{g.port}",
                    "names": names,
                    "checksums": True,
                },
                self.config.http_timeout_s,
                name=f"nccl-direct-receive-{g.key}",
            ),
            _spawn(
                self.sender.direct_send,
                g.key,
                wire,
                tuple(s.name for s in plan),
                name=f"nccl-direct-send-{g.key}",
            ),
        )
        timings["step"] = "done"
        sums = from_json(sent.pop("checksums"))
        timings.update(sent)
        replica = received[0] if received and isinstance(received[0], dict) else {}
        theirs = replica.pop("checksums", None)
        timings["receive"] = replica
        return sums, None if theirs is None else from_json(theirs)
