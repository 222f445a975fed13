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
fallback (``nccl``), e.g. for versions or models the extension cannot map (pipeline parallel).

**Tensor-parallel replicas.** Every worker of the replica joins the group (ranks 1..N); each
receives every tensor whole and keeps its own slice (:mod:`pool.shards`). The layout each rank
reports names those slices; the sender checksums each one (on the full tensor it sends, the same
slice) and the replica each rank's runtime block, so validation compares them rank by rank under
``"<name>@tp<rank>"``.

**Waves** (:mod:`.waves`): when the updater announces that k > 1 replicas are updated at once
(:meth:`NcclDirectTransport.expect_wave`), their transfers are gathered and sent together: one
group (sender + every worker of the wave, in URL order; a group per set of replicas, reused, on
ports from ``NcclConfig.wave_port_for``) and one broadcast per tensor for all of them, each
member receiving with a deadline of its own (``wave_receive_timeout_s``). A member whose receive
completed (and the sender's send) gets its evidence; every other member is re-sent alone, over
its own group, under its own cycle's deadline; a failed wave abandons its group. One member's
failure therefore taints only that member. ``wave_gather_s`` 0 turns waves off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from pool.checksum import Checksum, from_json
from pool.engine import VllmEngine
from pool.errors import PreflightFailed
from pool.evidence import TransferEvidence
from pool.types import TensorSpec
from updater.transports.base import WeightsTarget
from updater.transports.nccl.config import Packing
from updater.transports.nccl.control import HttpStepError
from updater.transports.nccl.senders import Rendezvous, Shard, WireSource, shard_key
from updater.transports.nccl.sources import nbytes_of
from updater.transports.nccl.threads import gather_threads, spawn
from updater.transports.nccl.transport import Group, NcclTransport
from updater.transports.nccl.versions import ApiFamily
from updater.transports.nccl.waves import Arrival, WaveBarrier

__all__ = ["NcclDirectTransport"]

log = logging.getLogger(__name__)

#: Per rank of a tensor-parallel replica: the slice ``(dim, start, length)`` of each tensor
#: it holds (a tensor it holds whole is absent).
RankShards = dict[str, tuple[int, int, int]]


@dataclass
class _WaveGroup:
    key: str
    urls: tuple[str, ...]
    port: int
    world_size: int
    epoch: int
    init_s: float


class NcclDirectTransport(NcclTransport):
    """The ``nccl`` transport's groups, checks and failure handling, with the direct receive of
    the module docstring. Constructed like :class:`NcclTransport` (in process with a
    ``source``, or service mode); ``self.packing`` is not used (one broadcast per tensor)."""

    name: ClassVar[str] = "nccl_direct"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shards: dict[str, list[RankShards] | None] = {}  # by URL, from its layout
        self._barrier = WaveBarrier(self.config.wave_gather_s, self._send_wave)
        self._wave_groups: dict[tuple[str, ...], _WaveGroup] = {}
        self._wave_index: dict[tuple[str, ...], int] = {}
        self._wave_incarnation: dict[tuple[str, ...], int] = {}
        self.last_waves: deque[dict[str, Any]] = deque(maxlen=64)  # the latest waves sent

    # -- checks ------------------------------------------------------------------------------

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """:meth:`NcclTransport.preflight`, then the replica's runtime layout against what
        would be sent (read-only ``rolloutpool_layout``, every worker). A refusal takes the
        replica out of a wave it was planned in."""
        try:
            await super().preflight(engine, target)
            checked = self._checked[engine.url.rstrip("/")]
            await self._check_layout(engine.url, list(checked.specs))
        except BaseException:
            self._barrier.leave(engine.url)
            raise

    async def _check_layout(self, url: str, specs: list[TensorSpec]) -> None:
        client = self._client(url)
        try:
            results = await asyncio.wrap_future(
                spawn(
                    client.collective_rpc,
                    "rolloutpool_layout",
                    {},
                    self.config.control_timeout_s,
                    name="nccl-direct-layout",
                )
            )
            ranks = sorted(results, key=lambda r: int(r.get("tp_rank", 0)))
            layouts: list[dict[str, Any]] = [r["layout"] for r in ranks]
            if not layouts:
                raise IndexError("no worker answered")
        except (HttpStepError, IndexError, KeyError, TypeError, AttributeError) as e:
            raise PreflightFailed(
                f"{url} did not report its weight layout (is it running with "
                f"--worker-extension-cls pool.replica_extension.WeightExtension?): {e}",
                url=url,
            ) from e
        for rank, layout in enumerate(layouts):
            bad = [s.name for s in specs if layout.get(s.name) != [s.dtype, list(s.shape)]]
            if bad:
                where = f"{url} (rank {rank} of {len(layouts)})" if len(layouts) > 1 else url
                raise PreflightFailed(
                    f"{where}: {len(bad)} tensors have no runtime view of the same dtype and "
                    f"shape, e.g. {bad[:3]} (runtime: {[layout.get(n) for n in bad[:3]]})",
                    url=url,
                )
        self._shards[url.rstrip("/")] = (
            [{n: (int(d), int(a), int(b)) for n, (d, a, b) in r["shards"].items()} for r in ranks]
            if len(ranks) > 1
            else None
        )

    # -- checksums per rank ----------------------------------------------------------------------

    def _shard_list(self, urls: Collection[str]) -> tuple[Shard, ...]:
        """Every slice a tensor-parallel rank of ``urls`` holds (the sender checksums each)."""
        out: set[Shard] = set()
        for url in urls:
            for rank in self._shards.get(url.rstrip("/")) or []:
                out.update((name, *where) for name, where in rank.items())
        return tuple(sorted(out))

    def _expected(
        self, url: str, sums: dict[str, Checksum], shard_sums: dict[str, Checksum]
    ) -> dict[str, Checksum]:
        """The sender's checksums as the replica at ``url`` reports its own: by name (TP=1),
        else per rank under ``"<name>@tp<rank>"``, of the slice that rank holds."""
        ranks = self._shards.get(url.rstrip("/"))
        if ranks is None:
            return sums
        out: dict[str, Checksum] = {}
        for r, held in enumerate(ranks):
            for name, c in sums.items():
                where = held.get(name)
                if where is None:
                    out[f"{name}@tp{r}"] = c
                elif shard_key((name, *where)) in shard_sums:
                    out[f"{name}@tp{r}"] = shard_sums[shard_key((name, *where))]
        return out

    @staticmethod
    def _received(results: Any) -> tuple[dict[str, Checksum] | None, dict[str, Any]]:
        """The replica's checksums (all ranks) and its receive timings, from the results of
        ``rolloutpool_direct_receive`` (one per worker)."""
        ranks = [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []
        sums: dict[str, Checksum] | None = {}
        for r in ranks:
            theirs = r.pop("checksums", None)
            if theirs is None or sums is None:
                sums = None
            else:
                sums.update(from_json(theirs))
        if len(ranks) <= 1:
            return (sums if ranks else None), (ranks[0] if ranks else {})
        return sums, {"receive_s": max(float(r.get("receive_s", 0)) for r in ranks), "ranks": ranks}

    # -- one replica -----------------------------------------------------------------------------

    def _plan(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The tensors put on the wire, in order: all of them. (The sender checksums every
        tensor of the source whatever this returns, so a plan that loses tensors is caught by
        validation: the negative control of ``bench/gpu_update.py`` overrides this.)"""
        return specs

    async def init_group(
        self, url: str, at: Rendezvous, family: ApiFamily, packing: Packing
    ) -> None:
        kwargs = {
            "master_address": at.address,
            "master_port": at.port,
            "world_size": at.world_size,
            "rank_offset": 1,
        }
        client = self._client(url)
        await gather_threads(
            spawn(
                client.collective_rpc,
                "rolloutpool_direct_init",
                kwargs,
                self.config.init_timeout_s,
                name=f"nccl-direct-init-http-{at.key}",
            ),
            spawn(self.sender.direct_init, at, name=f"nccl-direct-init-{at.key}"),
        )

    async def send_weights(
        self,
        url: str,
        g: Group,
        wire: WireSource,
        specs: list[TensorSpec],
        packing: Packing,
        timings: dict[str, Any],
    ) -> tuple[dict[str, Checksum], dict[str, Checksum] | None]:
        plan = self._plan(specs)
        names = [[s.name, s.dtype, list(s.shape)] for s in plan]
        client = self._client(url)
        timings["step"] = "receive"
        received, sent = await gather_threads(
            spawn(
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
            spawn(
                self.sender.direct_send,
                g.key,
                wire,
                tuple(s.name for s in plan),
                self._shard_list([url]),
                name=f"nccl-direct-send-{g.key}",
            ),
        )
        timings["step"] = "done"
        sums = from_json(sent.pop("checksums"))
        shard_sums = from_json(sent.pop("shard_checksums", {}))
        timings.update(sent)
        theirs, timings["receive"] = self._received(received)
        return self._expected(url, sums, shard_sums), theirs

    # -- waves ---------------------------------------------------------------------------------

    def expect_wave(self, urls: Collection[str]) -> None:
        """The next transfers into ``urls`` are one wave (see the module docstring)."""
        self._barrier.plan(urls)

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """:meth:`NcclTransport.transfer`, or, for a replica planned in a wave, its part of the
        wave's broadcast (or, where the wave could not serve it, a transfer alone)."""
        url = engine.url.rstrip("/")
        if not self._barrier.planned(url):
            return await super().transfer(engine, target)
        t_start = time.monotonic()
        try:
            checked = await self._checked_paused(engine, target)
        except BaseException:
            self._barrier.leave(url)
            raise
        outcome = await self._barrier.join(Arrival(url, engine, target, checked, t_start))
        if isinstance(outcome, TransferEvidence):
            return outcome
        log.info("%s: sent alone (%s)", url, outcome)
        ev = await self._transfer_checked(engine, target, checked, t_start)
        self._replica(url).last["alone"] = outcome
        return ev

    async def _send_wave(self, members: list[Arrival]) -> None:
        """One broadcast to every member (see the module docstring); sets each one's result."""
        members = sorted(members, key=lambda m: m.url)
        urls = tuple(m.url for m in members)
        checked = members[0].checked
        specs: list[TensorSpec] = list(checked.specs)
        wire = self._wire(checked.source)
        plan = self._plan(specs)
        nbytes = nbytes_of(specs)
        row: dict[str, Any] = {"replicas": list(urls), "bytes": nbytes}
        self.last_waves.append(row)
        try:
            g = await self._ensure_wave_group(members, row)
        except Exception as e:
            row["error"] = f"group: {type(e).__name__}: {e}"
            for m in members:
                m.result.set_result(f"the wave's group failed: {type(e).__name__}: {e}")
            return
        names = [[s.name, s.dtype, list(s.shape)] for s in plan]
        c = self.config
        t0 = time.monotonic()
        send = spawn(
            self.sender.direct_send,
            g.key,
            wire,
            tuple(s.name for s in plan),
            self._shard_list(urls),
            name=f"nccl-wave-send-{g.key}",
        )
        kwargs = {
            "group": f"{c.master_address}:{g.port}",
            "names": names,
            "checksums": True,
            "timeout_s": c.wave_receive_timeout_s,
        }
        receives = [
            asyncio.wrap_future(
                spawn(
                    self._client(url).collective_rpc,
                    "rolloutpool_direct_receive",
                    kwargs,
                    c.http_timeout_s,
                    name=f"nccl-wave-receive-{url}",
                )
            )
            for url in urls
        ]
        received = await asyncio.gather(*receives, return_exceptions=True)
        failed = [u for u, r in zip(urls, received, strict=True) if isinstance(r, BaseException)]
        if failed:  # the sender may be stuck in a broadcast nobody completes
            self._abandon_wave(g, f"receive failed on {failed}")
        sent: dict[str, Any] | BaseException
        try:
            async with asyncio.timeout(0.5 if failed else c.wave_receive_timeout_s):
                sent = await asyncio.wrap_future(send)
        except Exception as e:
            sent = e
            if not failed:
                self._abandon_wave(g, f"the sender failed: {type(e).__name__}: {e}")
        transfer_s = time.monotonic() - t0
        row.update(transfer_s=transfer_s, GBps=nbytes / transfer_s / 1e9, failed=failed)
        if isinstance(sent, BaseException):
            row["error"] = f"send: {type(sent).__name__}: {sent}"
            for m in members:
                m.result.set_result(f"the wave's send failed: {type(sent).__name__}: {sent}")
            return
        sums = from_json(sent.pop("checksums"))
        shard_sums = from_json(sent.pop("shard_checksums", {}))
        row.update(sent)
        for m, got in zip(members, received, strict=True):
            if isinstance(got, BaseException):
                m.result.set_result(f"its receive failed: {type(got).__name__}: {got}")
                continue
            theirs, receive = self._received(got)
            timings = {**row, "receive": receive, "wave_size": len(members)}
            timings["total_s"] = time.monotonic() - m.t_start
            self._replica(m.url).last = timings
            m.result.set_result(
                TransferEvidence(
                    transport=self.name,
                    identity_digest=m.target.identity.digest,
                    ok=True,
                    bytes=nbytes,
                    elapsed_s=transfer_s,
                    detail=json.dumps(timings, default=str),
                    checksums=self._expected(m.url, sums, shard_sums),
                    checksum_s=float(sent.get("checksum_s", 0.0)),
                    replica_checksums=theirs,
                )
            )

    async def _ensure_wave_group(self, members: list[Arrival], row: dict[str, Any]) -> _WaveGroup:
        """The group of exactly these replicas (reused), else a new one: every worker of every
        member joins (member i's workers from rank ``1 + workers before it``), with the
        sender as rank 0. A failed init raises; the next attempt uses a new port."""
        urls = tuple(m.url for m in members)
        g = self._wave_groups.get(urls)
        if g is not None and g.epoch == self.sender.epoch:
            row["init_s"] = 0.0
            return g
        if g is not None:
            self._abandon_wave(g, "the sender changed")
        c = self.config
        sizes = [
            (await m.engine.world_size(timeout_s=c.control_timeout_s)).world_size for m in members
        ]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        index = self._wave_index.setdefault(urls, len(self._wave_index))
        incarnation = self._wave_incarnation.get(urls, 0)
        port = c.wave_port_for(index, incarnation)
        key = f"wave:{'+'.join(urls)}#{incarnation}"
        at = Rendezvous(key, c.master_address, port, world)
        t0 = time.monotonic()
        try:
            await gather_threads(
                *(
                    spawn(
                        self._client(url).collective_rpc,
                        "rolloutpool_direct_init",
                        {
                            "master_address": c.master_address,
                            "master_port": port,
                            "world_size": world,
                            "rank_offset": offset,
                        },
                        c.init_timeout_s,
                        name=f"nccl-wave-init-http-{url}",
                    )
                    for url, offset in zip(urls, offsets, strict=True)
                ),
                spawn(self.sender.direct_init, at, name=f"nccl-wave-init-{key}"),
            )
        except BaseException:
            self._wave_incarnation[urls] = incarnation + 1
            with contextlib.suppress(Exception):
                self.sender.abandon(key)
            raise
        g = _WaveGroup(key, urls, port, world, self.sender.epoch, time.monotonic() - t0)
        self._wave_groups[urls] = g
        row.update(init_s=g.init_s, port=port, world_size=world)
        return g

    def _abandon_wave(self, g: _WaveGroup, why: str) -> None:
        log.warning("abandoning NCCL wave group %s (port %d): %s", g.key, g.port, why)
        if self._wave_groups.get(g.urls) is g:
            del self._wave_groups[g.urls]
            self._wave_incarnation[g.urls] = self._wave_incarnation.get(g.urls, 0) + 1
        with contextlib.suppress(Exception):
            self.sender.abandon(g.key)

    def forget(self, url: str) -> None:
        """:meth:`NcclTransport.forget`, and every wave group the replica was part of."""
        super().forget(url)
        clean = url.rstrip("/")
        self._shards.pop(clean, None)
        for g in [g for g in self._wave_groups.values() if clean in g.urls]:
            self._abandon_wave(g, "a member was forgotten")

    def close(self) -> None:
        self._wave_groups.clear()
        super().close()
