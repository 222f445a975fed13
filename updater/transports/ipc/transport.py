"""``ipc_direct``: a replica copies a staged copy of the weights over CUDA IPC, on its GPU.

The sender (a trainer, or whoever owns the :class:`~updater.transports.ipc.staging.IpcStaging`)
lays its weights out once per shape in a staging buffer on its GPU; each replica opens one CUDA
IPC handle per buffer (kept open) and a transfer is one ``/collective_rpc`` in which the
replica's worker extension copies every staged tensor into its runtime parameter
(:meth:`pool.replica_extension.WeightExtension.rolloutpool_ipc_copy`: the ``nccl_direct``
mapping of names, fused blocks and TP slices; one pass that copies and checksums where the
layout allows). Same-GPU senders are the case this is built for; a sender on another
GPU of the same host works where the replica's workers can see that GPU and reach it by peer
access. No NCCL group, no start/finish, no ``load_weights``.

**Where the staged copy comes from** (:meth:`IpcDirectTransport._staged`):

* in process (``IpcDirectTransport(staging)``): the copy ``staging.find(key)`` for the target's
  identity digest (:meth:`~updater.transports.ipc.staging.IpcStaging.stage` with that key);
* service mode (no ``staging``; the updater's ``ipc_direct``): the checkpoint directory of the
  target holds :data:`~updater.transports.ipc.staging.SIDECAR`, the
  :class:`~updater.transports.ipc.staging.IpcDescriptor` of the staged copy it was written from
  (:meth:`updater.client.UpdaterClient.push_module` writes both).

**Fallback.** A target with no staged copy (none was staged, the sidecar is missing, the
replica cannot reach or open the buffer, or the buffer no longer holds that copy) goes to
``fallback`` when there is one (service mode: ``reload`` with checksums, from the target's
checkpoint), else is refused in preflight. Recovery (I6) of a replica whose latest generation
was pushed from memory therefore loads, into the fresh process, the staged copy while the
trainer still holds it (2 slots keep the latest published one while the next rolls), else the
checkpoint that was written from it and confirmed before the update was submitted; either way
validated by checksums.

**Failure classes.** Preflight is read-only (``rolloutpool_layout``,
``rolloutpool_ipc_check``, which opens the handle and reads the copy's tag). In the transfer, a
refusal every worker *answers* before writing (unreachable device, unopenable handle, a
buffer that no longer holds the copy, a name with no runtime view) is
:class:`~pool.errors.NoMutation`, as is an engine that is not paused; anything else once the
call was sent (an error, a timeout, one worker refusing while another copied, a buffer
rewritten during the copy) is :class:`~pool.errors.AmbiguousMutation`.

**Checksums** as for ``nccl_direct``: the sender's, computed over the staged copy once per copy
(outside the paused window: in preflight), against the replica's, computed over the words
written into each runtime view (:mod:`pool.ipc_copy`), compared in VALIDATING; per rank
(``"<name>@tp<rank>"``) for a tensor-parallel replica.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import ValidationError

from pool.checksum import Checksum, from_json
from pool.engine import VllmEngine
from pool.errors import AmbiguousMutation, EngineError, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from pool.ipc_handles import Entry, IpcHandle
from pool.types import Manifest, TensorSpec
from updater.transports.base import Transport, TransportSettings, WeightsTarget
from updater.transports.ipc.staging import SIDECAR, IpcDescriptor, IpcStaging, StagedCopy
from updater.transports.nccl.senders import Shard, shard_key
from updater.transports.preflight import check_weights
from updater.transports.reload import ReloadTransport

__all__ = ["IpcDirectTransport"]

#: Per rank of a tensor-parallel replica: the slice ``(dim, start, length)`` of each tensor it
#: holds (a tensor it holds whole is absent).
RankShards = dict[str, tuple[int, int, int]]


def _replica_sums(raw: Any, url: str) -> dict[str, Checksum]:
    """A worker's checksums (one JSON string); anything else once the copy ran is ambiguous."""
    try:
        return from_json(json.loads(raw))
    except (TypeError, ValueError, KeyError) as e:
        raise AmbiguousMutation(
            f"{url} copied but its checksums are unreadable: {e}", url=url
        ) from e


class NoStagedCopy(Exception):
    """The target has no staged copy this replica can load (why: the message)."""


@dataclass(frozen=True)
class _Staged:
    """A staged copy as the transfer uses it."""

    handle: IpcHandle
    entries: tuple[Entry, ...]
    tag: int
    copy: StagedCopy | None  # in process: the sums of slices are computed from it
    sums: dict[str, Checksum] | None  # service mode: the descriptor's

    def manifest(self) -> Manifest:
        return Manifest.of(
            [TensorSpec(name=e.name, shape=e.shape, dtype=e.dtype) for e in self.entries]
        )


@dataclass(frozen=True)
class _Plan:
    """What preflight chose for one replica: the staged copy (with the ranks' slices), or
    ``staged`` None: the fallback, for ``why``."""

    target: WeightsTarget
    staged: _Staged | None
    shards: tuple[RankShards, ...] | None = None
    why: str = ""


class IpcDirectTransport(Transport):
    """See the module docstring. ``staging``: in process; else service mode (sidecars).
    ``fallback``: the transport for targets without a usable staged copy. ``checksums``:
    offer the sender's checksums (and have the replica compute its own) on every transfer.
    Timings of the last transfer into each replica are in :attr:`last`."""

    name: ClassVar[str] = "ipc_direct"

    def __init__(
        self,
        staging: IpcStaging | None = None,
        *,
        fallback: Transport | None = None,
        checksums: bool = True,
        rpc_timeout_s: float = 120.0,
        control_timeout_s: float = 30.0,
    ) -> None:
        self.staging = staging
        self.fallback = fallback
        self.checksums = checksums
        self.rpc_timeout_s = rpc_timeout_s
        self.control_timeout_s = control_timeout_s
        self._plans: dict[str, _Plan] = {}  # by URL: what its last preflight chose
        self.last: dict[str, dict[str, Any]] = {}

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """Service mode; the fallback is ``reload`` with checksums (the replicas run the
        worker extension anyway)."""
        return cls(fallback=ReloadTransport(checksums=True))

    def forget(self, url: str) -> None:
        self._plans.pop(url.rstrip("/"), None)
        if self.fallback is not None:
            self.fallback.forget(url)

    # -- choosing --------------------------------------------------------------------------------

    def _staged(self, target: WeightsTarget) -> _Staged:
        """The staged copy of ``target`` (see the module docstring), or :class:`NoStagedCopy`."""
        if self.staging is not None:
            copy = self.staging.find(target.identity.digest)
            if copy is None:
                raise NoStagedCopy(f"nothing staged for identity {target.identity.digest[:12]}")
            handle = self.staging.handle(copy)
            return _Staged(handle, copy.entries, copy.tag, copy, None)
        path = Path(target.path) / SIDECAR
        try:
            desc = IpcDescriptor.model_validate_json(path.read_bytes())
            return _Staged(
                desc.ipc_handle(),
                tuple(desc.parsed_entries()),
                desc.tag,
                None,
                from_json(desc.checksums),
            )
        except FileNotFoundError as e:
            raise NoStagedCopy(f"{path} does not exist") from e
        except (OSError, ValueError, ValidationError) as e:
            raise NoStagedCopy(f"{path} is unreadable: {e}") from e

    async def _choose(self, engine: VllmEngine, target: WeightsTarget) -> _Plan:
        """Preflight's decision (read-only; see the module docstring)."""
        try:
            staged = await asyncio.to_thread(self._staged, target)
        except NoStagedCopy as e:
            return await self._fall_back(engine, target, str(e))
        check_weights(target, staged.manifest(), what="staged copy")
        shards = await self._check_layout(engine, staged)
        kwargs = {"buffer": json.dumps(staged.handle.to_json()), "tag": json.dumps(staged.tag)}
        try:
            rpc = await engine.collective_rpc(
                "rolloutpool_ipc_check", kwargs, timeout_s=self.control_timeout_s
            )
            refused = [str(r.get("refused")) for r in rpc.results if not r.get("ok")]
        except (EngineError, AttributeError) as e:
            raise PreflightFailed(f"{engine.url} could not check the staging buffer: {e}") from e
        if refused or not rpc.results:
            return await self._fall_back(engine, target, "; ".join(refused) or "no worker")
        if self.checksums and staged.copy is not None and self.staging is not None:
            await asyncio.to_thread(self.staging.checksums, staged.copy)  # out of the window
        return _Plan(target, staged, shards)

    async def _fall_back(self, engine: VllmEngine, target: WeightsTarget, why: str) -> _Plan:
        if self.fallback is None:
            raise PreflightFailed(f"ipc_direct cannot serve {engine.url}: {why}", url=engine.url)
        await self.fallback.preflight(engine, target)
        return _Plan(target, None, why=why)

    async def _check_layout(
        self, engine: VllmEngine, staged: _Staged
    ) -> tuple[RankShards, ...] | None:
        """Every staged tensor must have a runtime view of the same dtype and (full) shape on
        every worker (read-only ``rolloutpool_layout``); returns each rank's slices (TP > 1)."""
        try:
            rpc = await engine.collective_rpc(
                "rolloutpool_layout", timeout_s=self.control_timeout_s
            )
            ranks = sorted(rpc.results, key=lambda r: int(r.get("tp_rank", 0)))
            layouts: list[dict[str, Any]] = [r["layout"] for r in ranks]
            if not layouts:
                raise IndexError("no worker answered")
        except (EngineError, IndexError, KeyError, TypeError, AttributeError) as e:
            raise PreflightFailed(
                f"{engine.url} did not report its weight layout (is it running with "
                f"--worker-extension-cls pool.replica_extension.WeightExtension?): {e}",
                url=engine.url,
            ) from e
        for rank, lay in enumerate(layouts):
            bad = [e.name for e in staged.entries if lay.get(e.name) != [e.dtype, list(e.shape)]]
            if bad:
                raise PreflightFailed(
                    f"{engine.url} (rank {rank}): {len(bad)} staged tensors have no runtime view "
                    f"of the same dtype and shape, e.g. {bad[:3]}",
                    url=engine.url,
                )
        if len(ranks) == 1:
            return None
        if staged.copy is None:
            raise PreflightFailed(
                f"{engine.url} is tensor-parallel: ipc_direct needs the staging in process "
                "for the checksums of its slices",
                url=engine.url,
            )
        return tuple(
            {n: (int(d), int(a), int(b)) for n, (d, a, b) in r["shards"].items()} for r in ranks
        )

    # -- Transport -------------------------------------------------------------------------------

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Choose the staged copy or the fallback for ``target`` on this replica (read-only;
        the fallback's own preflight runs when it is chosen); kept for the next transfer."""
        url = engine.url.rstrip("/")
        self._plans.pop(url, None)
        self._plans[url] = await self._choose(engine, target)

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """Load ``target`` into the paused ``engine`` (failure classes: module docstring)."""
        url = engine.url.rstrip("/")
        plan = self._plans.pop(url, None)
        if plan is None or plan.target != target:
            plan = await self._choose(engine, target)
        if plan.staged is None:
            assert self.fallback is not None
            ev = await self.fallback.transfer(engine, target)
            self.last[url] = {"path": self.fallback.name, "why": plan.why}
            return ev
        if not await engine.is_paused():
            raise NoMutation(f"refusing to copy weights into {engine.url}: not paused", url=url)
        staged = plan.staged
        entries = self._send_entries(list(staged.entries))
        kwargs = {
            "buffer": json.dumps(staged.handle.to_json()),
            "entries": json.dumps([e.to_json() for e in entries]),
            "tag": json.dumps(staged.tag),
            "checksums": json.dumps(self.checksums),
        }
        t0 = time.monotonic()
        rpc = await engine.collective_rpc(
            "rolloutpool_ipc_copy", kwargs, timeout_s=self.rpc_timeout_s
        )
        elapsed = time.monotonic() - t0
        results = list(rpc.results)
        if not results or not all(isinstance(r, dict) for r in results):
            raise AmbiguousMutation(f"rolloutpool_ipc_copy on {url}: {results!r:.300}", url=url)
        refused = [str(r["refused"]) for r in results if "refused" in r]
        if refused and len(refused) == len(results):
            raise NoMutation(f"{url} refused the staged copy: {refused[0]}", url=url)
        if refused:
            raise AmbiguousMutation(f"{url}: some workers copied, one refused: {refused}", url=url)
        nbytes = sum(e.nbytes for e in staged.entries)
        theirs: dict[str, Checksum] | None = None
        if self.checksums:
            theirs = {}
            for r in results:
                theirs.update(_replica_sums(r.get("checksums"), url))
        sums, sums_s = await self._sender_sums(staged, plan.shards)
        timings = {
            "path": self.name,
            "transfer_s": elapsed,
            "bytes": nbytes,
            "GBps": nbytes / elapsed / 1e9 if elapsed else 0.0,
            "receive": [{k: v for k, v in r.items() if k != "checksums"} for r in results],
        }
        self.last[url] = timings
        return TransferEvidence(
            transport=self.name,
            identity_digest=target.identity.digest,
            ok=True,
            bytes=nbytes,
            elapsed_s=elapsed,
            detail=json.dumps(timings, default=str),
            checksums=sums,
            checksum_s=sums_s,
            replica_checksums=theirs,
        )

    def _send_entries(self, entries: list[Entry]) -> list[Entry]:
        """The entries the replica is asked to copy: all of them. (The sender's checksums cover
        every staged tensor whatever this returns, so a plan that loses tensors is caught by
        validation: the negative control of ``bench/gpu_ipc.py`` overrides this.)"""
        return entries

    async def _sender_sums(
        self, staged: _Staged, shards: tuple[RankShards, ...] | None
    ) -> tuple[dict[str, Checksum] | None, float]:
        """The sender's checksums, as the replica reports its own (per rank for TP > 1)."""
        if not self.checksums:
            return None, 0.0
        t0 = time.monotonic()
        if staged.copy is None or self.staging is None:
            return staged.sums, 0.0
        staging, copy = self.staging, staged.copy
        sums = await asyncio.to_thread(staging.checksums, copy)
        if shards is None:
            return sums, time.monotonic() - t0
        wanted: set[Shard] = {(n, *w) for rank in shards for n, w in rank.items()}
        shard_sums = await asyncio.to_thread(staging.shard_checksums, copy, tuple(sorted(wanted)))
        out: dict[str, Checksum] = {}
        for r, held in enumerate(shards):
            for name, c in sums.items():
                where = held.get(name)
                key = None if where is None else shard_key((name, *where))
                out[f"{name}@tp{r}"] = c if key is None else shard_sums[key]
        return out, time.monotonic() - t0
