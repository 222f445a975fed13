"""The NCCL transport: one paused replica at a time, over a per-replica NCCL group.

**Group lifetime.** One NCCL group per replica (keyed by URL): world size =
``GET /get_world_size`` + 1 (the trainer is rank 0, the replica's workers ranks 1..N). It is
created by the first transfer and reused. Any failed or abandoned transfer *abandons* it: the
trainer-side communicator is aborted (``ncclCommAbort`` through vLLM's
``PyNcclCommunicator.destroy``) or, with ``sender="process"``, the sending process is killed, and
the next transfer to that URL creates a new group on a new port (``port_stride`` further on: an
abandoned rendezvous may still hold the old one). A replica restarted for any other reason than
a failed transfer keeps a stale group here: call :meth:`NcclTransport.forget` after restarting
it. (Without that, the fresh server answers ``/update_weights`` with a 500 at once, the transfer
fails ambiguously and the replica goes through recovery once more: safe, but slower.)

**Blocking calls and deadlines.** ``/init_weight_transfer_engine`` and ``/update_weights`` block
inside NCCL on the server and vLLM sets no timeout on a broadcast. They are sent from daemon
threads, concurrently with the trainer-side join / broadcast (also in a daemon thread). The
coroutine only awaits those threads, so the updater's deadline (:func:`updater.deadline.bounded`)
can abandon it at any time: on cancellation the group is abandoned as above, the threads are
left to die with their HTTP timeouts, and the cycle runner marks the replica TAINTED. A thread
that ends with an error ends the transfer at once (a sender that died is noticed before the
deadline).

**Failure classes** (see :mod:`updater.transports.base`): a manifest / identity / version
mismatch is :class:`~pool.errors.PreflightFailed`; an unpaused engine, an unreachable server or a
4xx on the group init is :class:`~pool.errors.NoMutation`; everything after
``/start_weight_update`` (which moves the model's layers to the meta device for vLLM's layerwise
reload) is :class:`~pool.errors.AmbiguousMutation`, as is a group init that failed any other way
(the engine loop may still be blocked in the rendezvous).

**Checks, once per transfer path.** :meth:`NcclTransport.preflight` runs the shared target check
(:mod:`updater.transports.preflight`: in service mode location, manifest, identity and
provenance of the checkpoint; in process the source's manifest against the declared identity)
and the version check, and keeps the result for that replica. The next
:meth:`NcclTransport.transfer` of the same target to it sends what was checked without checking
again; a transfer without that preflight runs the same checks itself, before anything is sent.

The transport's methods run on the updater's event loop (not thread-safe); blocking work goes to
daemon threads as above, and transferring into one replica at a time is the caller's business
(:mod:`updater.transports.base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import httpx

from pool.checksum import Checksum
from pool.engine import VllmEngine, parse_version
from pool.errors import AmbiguousMutation, NoMutation, PreflightFailed
from pool.evidence import TransferEvidence
from pool.types import Manifest, TensorSpec
from updater.transports.base import Transport, TransportSettings, WeightsTarget
from updater.transports.nccl.config import NcclConfig, Packing
from updater.transports.nccl.control import HttpStepError, HttpWeightSyncClient
from updater.transports.nccl.senders import (
    ProcessSender,
    Rendezvous,
    Sender,
    ThreadSender,
    WireSource,
)
from updater.transports.nccl.sources import CheckpointSource, SourceSlot, WeightSource, nbytes_of
from updater.transports.nccl.threads import gather_threads, spawn
from updater.transports.nccl.versions import ApiFamily, check_versions, local_vllm_version
from updater.transports.preflight import check_location, check_provenance, check_weights

__all__ = ["Group", "NcclTransport"]

log = logging.getLogger(__name__)


@dataclass
class Group:
    """The NCCL group of one replica: its rendezvous ``key`` (``<url>#<incarnation>``), the
    ``port`` it was created on, its ``world_size`` (the sender + the replica's workers), the API
    family and packing it was created for, and the sender ``epoch`` it belongs to."""

    key: str
    url: str
    port: int
    world_size: int
    family: ApiFamily
    packing: Packing
    epoch: int = 0
    init_s: float = 0.0


@dataclass(frozen=True)
class _Checked:
    """What the check of ``target`` established for one replica: the transfer that follows the
    preflight sends exactly this source, in this order, with this API family."""

    target: WeightsTarget
    source: WeightSource
    specs: tuple[TensorSpec, ...]
    family: ApiFamily


@dataclass
class _Replica:
    index: int
    incarnation: int = 0
    group: Group | None = None
    last: dict[str, Any] = field(default_factory=dict)
    client: HttpWeightSyncClient | None = None  # the replica's one control client


class NcclTransport(Transport):
    """Broadcasts weights to one paused replica at a time over a per-replica NCCL group.

    ``source``: a :class:`WeightSource` (in-process mode) or None (service mode: each target's
    checkpoint). ``sender``: ``"thread"`` (this process) or ``"process"`` (a child process;
    service mode or sources with a :meth:`WeightSource.spec`). ``sender_impl`` replaces the
    sender (tests). The per-replica timings of the last transfer are in :attr:`last`.

    **Extension point.** A transport that moves the bytes into the replica another way (the
    ``nccl_direct`` receive, :mod:`updater.transports.nccl.direct`) subclasses this one and
    overrides two hooks: :meth:`init_group` (both sides of a new group) and
    :meth:`send_weights` (one transfer over a group). The checks, the groups' lifetime and
    ports, the deadlines and the failure classes stay this class's; both hooks run their
    blocking calls in daemon threads (:mod:`updater.transports.nccl.threads`).
    """

    name: ClassVar[str] = "nccl"

    def __init__(
        self,
        config: NcclConfig | None = None,
        source: WeightSource | None = None,
        *,
        sender: Literal["thread", "process"] = "thread",
        sender_impl: Sender | None = None,
        http_transport: httpx.BaseTransport | None = None,
        local_version: str | None = None,
    ) -> None:
        self.config = config or NcclConfig()
        self.source = source
        self.packing = self.config.packing
        if sender_impl is not None:
            self.sender: Sender = sender_impl
        elif sender == "process":
            if source is not None and source.spec() is None:
                raise ValueError("sender='process' needs a source with a spec() (or service mode)")
            self.sender = ProcessSender(self.config.device)
        else:
            self.sender = ThreadSender(self.config.device)
        self._http_transport = http_transport
        self._local_version = local_version
        self._replicas: dict[str, _Replica] = {}
        self._checkpoints: SourceSlot[Path] = SourceSlot()  # service mode: by checkpoint path
        self._checked: dict[str, _Checked] = {}  # by replica URL: its last passed preflight

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> Self:
        """Service mode with ``settings.nccl``, sending from a thread of the updater."""
        return cls(settings.nccl)

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def last(self) -> dict[str, dict[str, Any]]:
        return {url: r.last for url, r in self._replicas.items()}

    def _replica(self, url: str) -> _Replica:
        url = url.rstrip("/")
        if url not in self._replicas:
            self._replicas[url] = _Replica(index=len(self._replicas))
        return self._replicas[url]

    def forget(self, url: str) -> None:
        """Drop (and abandon) the group of the replica at ``url``, and what its last preflight
        checked: call after restarting it."""
        self._checked.pop(url.rstrip("/"), None)
        rep = self._replica(url)
        if rep.group is not None:
            self._abandon(rep, "forgotten")

    def _abandon(self, rep: _Replica, why: str) -> None:
        g = rep.group
        if g is None:
            return
        log.warning("abandoning NCCL group %s (port %d): %s", g.key, g.port, why)
        rep.group = None
        rep.incarnation += 1
        if rep.client is not None:  # calls still in flight (abandoned) keep only their own
            rep.client.close()
            rep.client = None
        with contextlib.suppress(Exception):
            self.sender.abandon(g.key)

    def close(self) -> None:
        for rep in self._replicas.values():
            rep.group = None
            if rep.client is not None:
                rep.client.close()
        self.sender.close()

    def _client(self, url: str) -> HttpWeightSyncClient:
        """The control client of the replica at ``url``, one per replica for the transport's
        life (keep-alive; :mod:`~updater.transports.nccl.control`): every HTTP call of a group
        init or a transfer (this transport's and vLLM's trainer engine's) goes through it."""
        rep = self._replica(url)
        if rep.client is None:
            c = self.config
            rep.client = HttpWeightSyncClient(
                url,
                timeout_s=c.http_timeout_s,
                init_timeout_s=c.init_timeout_s,
                control_timeout_s=c.control_timeout_s,
                transport=self._http_transport,
            )
        return rep.client

    # -- what to send ------------------------------------------------------------------------

    def _source_for(self, target: WeightsTarget) -> WeightSource:
        if self.source is not None:
            return self.source
        path = target.path
        return self._checkpoints.get(path, lambda: CheckpointSource(path, self.config.device))

    def _wire(self, src: WeightSource) -> WireSource:
        if isinstance(self.sender, ProcessSender):
            spec = src.spec()
            if spec is None:
                raise PreflightFailed("this source cannot be sent from a child process")
            return spec
        return src

    def _read_source(self, target: WeightsTarget) -> tuple[WeightSource, list[TensorSpec]]:
        """The source for ``target`` and its parameters in send order (blocking: headers of a
        checkpoint, or the module's parameter list). Refuses unreadable or repeated names."""
        src = self._source_for(target)
        try:
            specs = src.specs()
        except PreflightFailed:
            raise
        except Exception as e:
            raise PreflightFailed(
                f"cannot read the source's parameters: {e}", identity=target.identity.digest
            ) from e
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise PreflightFailed(
                "the source yields a parameter name twice", identity=target.identity.digest
            )
        return src, specs

    async def _check(self, engine: VllmEngine, target: WeightsTarget) -> _Checked:
        """The checks of one transfer path, each run once: the shared target check
        (:mod:`updater.transports.preflight`) on what would be sent, then the vLLM versions.
        Local reads plus read-only calls (``/version``); a refusal is ``PreflightFailed``."""
        service = self.source is None
        if service:
            check_location(target)
        src, specs = await asyncio.to_thread(self._read_source, target)
        check_weights(target, Manifest.of(specs), what="checkpoint" if service else "source")
        if service:
            await check_provenance(target, verify_content_hash=self.config.verify_content_hash)
        return _Checked(target, src, tuple(specs), await self._family(engine))

    async def _family(self, engine: VllmEngine) -> ApiFamily:
        try:
            caps = engine.capabilities
        except RuntimeError:
            caps = await engine.bootstrap()  # read-only
        local = self._local_version or local_vllm_version()
        return check_versions(
            caps.version_tuple,
            None if local is None else parse_version(local),
            same_minor=self.config.require_same_vllm_minor,
        )

    # -- Transport ---------------------------------------------------------------------------

    async def preflight(self, engine: VllmEngine, target: WeightsTarget) -> None:
        """Refuse unless what would be sent matches the replica's manifest and the declared
        identity and the vLLM versions can talk (:meth:`_check`); in service mode, warm the
        source (load the checkpoint onto the sender's GPU, outside the paused window). Only
        read-only calls reach the engine (``/version``). What passed is kept for the next
        :meth:`transfer` of this target to this replica, which then does not check again."""
        checked = await self._check(engine, target)
        if self.source is None:
            wire = self._wire(checked.source)
            try:
                await asyncio.wrap_future(spawn(self.sender.prepare, wire, name="nccl-prepare"))
            except Exception as e:
                raise PreflightFailed(
                    f"cannot load {target.path} onto {self.config.device}: {e}",
                    path=str(target.path),
                ) from e
        self._checked[engine.url.rstrip("/")] = checked

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        """Send ``target`` into ``engine`` (which must be paused). See the module docstring for
        the failure classes; timings of this transfer go to ``self.last[url]``."""
        t_start = time.monotonic()
        checked = await self._checked_paused(engine, target)
        return await self._transfer_checked(engine, target, checked, t_start)

    async def _checked_paused(self, engine: VllmEngine, target: WeightsTarget) -> _Checked:
        """What the preflight of ``target`` checked for this replica (else the same checks
        now), once the engine is confirmed paused (else :class:`~pool.errors.NoMutation`)."""
        checked = self._checked.pop(engine.url.rstrip("/"), None)
        if checked is None or checked.target != target:  # not preflighted: check before any call
            checked = await self._check(engine, target)
        if not await engine.is_paused():
            raise NoMutation(
                f"refusing to send weights into {engine.url}: not paused", url=engine.url
            )
        return checked

    async def _transfer_checked(
        self, engine: VllmEngine, target: WeightsTarget, checked: _Checked, t_start: float
    ) -> TransferEvidence:
        """:meth:`transfer` once :meth:`_checked_paused` passed: over this replica's group."""
        specs, family = list(checked.specs), checked.family
        rep = self._replica(engine.url)
        packing = self.packing
        wire = self._wire(checked.source)
        nbytes = nbytes_of(specs)
        timings: dict[str, Any] = {
            "family": family,
            "bytes": nbytes,
            "packing": packing.model_dump(),
        }
        group = await self._ensure_group(engine, rep, family, packing, timings)
        try:
            t0 = time.monotonic()
            sums, replica_sums = await self.send_weights(
                engine.url, group, wire, specs, packing, timings
            )
            timings["transfer_s"] = time.monotonic() - t0
        except BaseException as e:  # CancelledError (deadline) included: the group is unusable
            self._abandon(rep, f"transfer failed: {type(e).__name__}: {e}")
            timings["error"] = f"{type(e).__name__}: {e}"
            rep.last = timings
            if isinstance(e, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            raise AmbiguousMutation(
                f"NCCL transfer into {engine.url} failed after it began: {type(e).__name__}: {e}",
                url=engine.url,
                step=timings.get("step"),
            ) from e
        timings["total_s"] = time.monotonic() - t_start
        timings["GBps"] = nbytes / timings["transfer_s"] / 1e9 if timings["transfer_s"] else 0
        rep.last = timings
        return TransferEvidence(
            transport=self.name,
            identity_digest=target.identity.digest,
            ok=True,
            bytes=nbytes,
            elapsed_s=timings["transfer_s"],
            detail=json.dumps({k: v for k, v in timings.items() if k != "chunks"}, default=str),
            checksums=sums,
            checksum_s=float(timings.get("checksum_s", 0.0)),
            replica_checksums=replica_sums,
        )

    async def send_weights(
        self,
        url: str,
        g: Group,
        wire: WireSource,
        specs: list[TensorSpec],
        packing: Packing,
        timings: dict[str, Any],
    ) -> tuple[dict[str, Checksum] | None, dict[str, Checksum] | None]:
        """The hook that moves the weights ``specs`` of ``wire`` over ``g`` into the replica at
        ``url`` (paused; the group initialised by :meth:`init_group`), recording its timings
        in ``timings`` (``timings["step"]`` names the step under way). Returns the sender's and
        the replica's checksums where the path computes them (vLLM's own path: neither).
        Anything it raises after it began is an ambiguous transfer."""
        if g.family == "static":
            await self._send_static(url, g, wire, specs, packing, timings)
        else:
            timings.update(
                await asyncio.wrap_future(
                    spawn(self.sender.factory_send, g.key, wire, name=f"nccl-send-{g.key}")
                )
            )
        return None, None

    async def _ensure_group(
        self,
        engine: VllmEngine,
        rep: _Replica,
        family: ApiFamily,
        packing: Packing,
        timings: dict[str, Any],
    ) -> Group:
        g = rep.group
        epoch = self.sender.epoch
        if g is not None and (
            g.family != family or g.epoch != epoch or (family == "factory" and g.packing != packing)
        ):
            self._abandon(rep, "stale group (packing, API or sender changed)")
            g = None
        if g is not None:
            return g
        ws = (await engine.world_size(timeout_s=self.config.control_timeout_s)).world_size + 1
        url = engine.url.rstrip("/")
        try:
            port = self.config.port_for(url, rep.index, rep.incarnation)
        except ValueError as e:
            raise NoMutation(str(e), url=url) from e
        key = f"{url}#{rep.incarnation}"
        at = Rendezvous(key, self.config.master_address, port, ws)
        t0 = time.monotonic()
        timings["step"] = "init"
        try:
            await self.init_group(url, at, family, packing)
        except BaseException as e:
            rep.incarnation += 1  # the port may still be held by the half-open rendezvous
            with contextlib.suppress(Exception):
                self.sender.abandon(key)
            if isinstance(e, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(e, HttpStepError) and e.refused:
                raise NoMutation(
                    f"NCCL group init refused by {url}: {e}", url=url, port=port
                ) from e
            raise AmbiguousMutation(
                f"NCCL group init with {url} failed: {type(e).__name__}: {e}", url=url, port=port
            ) from e
        g = Group(
            key=key,
            url=url,
            port=port,
            world_size=ws,
            family=family,
            packing=packing,
            epoch=self.sender.epoch,
            init_s=time.monotonic() - t0,
        )
        rep.group = g
        timings["init_s"] = g.init_s
        timings["port"] = port
        timings["world_size"] = ws
        return g

    async def init_group(
        self, url: str, at: Rendezvous, family: ApiFamily, packing: Packing
    ) -> None:
        """The hook that creates the group at ``at`` with the replica at ``url``: the server's
        side and the sender's, concurrently (both block until every rank joined). A refusal
        before anything was sent raises :class:`~updater.transports.nccl.control.HttpStepError`
        with ``refused`` set (NoMutation); anything else is ambiguous."""
        if family == "static":
            init_info = {
                "master_address": at.address,
                "master_port": at.port,
                "rank_offset": 1,
                "world_size": at.world_size,
            }
            await gather_threads(
                spawn(
                    self._client(url).init_weight_transfer_engine,
                    init_info,
                    name=f"nccl-init-http-{at.key}",
                ),
                spawn(self.sender.static_init, at, name=f"nccl-init-{at.key}"),
            )
        else:
            await asyncio.wrap_future(
                spawn(
                    self.sender.factory_init,
                    at,
                    packing,
                    self._client(url),
                    name=f"nccl-init-{at.key}",
                )
            )

    async def _send_static(
        self,
        url: str,
        g: Group,
        wire: WireSource,
        specs: list[TensorSpec],
        packing: Packing,
        timings: dict[str, Any],
    ) -> None:
        client = self._client(url)
        update_info: dict[str, Any] = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packed": packing.packed,
            "packed_buffer_size_bytes": packing.buffer_bytes,
            "packed_num_buffers": packing.num_buffers,
        }
        timings["step"] = "start"
        t = time.monotonic()
        await asyncio.wrap_future(spawn(client.start_weight_update, name=f"nccl-start-{g.key}"))
        timings["start_s"] = time.monotonic() - t
        timings["step"] = "update"
        t = time.monotonic()
        http_done: dict[str, float] = {}

        def update() -> None:
            client.update_weights(update_info)
            http_done["t"] = time.monotonic()

        _, sent = await gather_threads(
            spawn(update, name=f"nccl-update-http-{g.key}"),
            spawn(
                self.sender.static_send,
                g.key,
                wire,
                packing,
                self.config.chunk_timings,
                name=f"nccl-send-{g.key}",
            ),
        )
        timings["update_s"] = time.monotonic() - t
        timings["update_http_s"] = http_done.get("t", time.monotonic()) - t
        timings.update(sent)
        timings["step"] = "finish"
        t = time.monotonic()
        await asyncio.wrap_future(spawn(client.finish_weight_update, name=f"nccl-finish-{g.key}"))
        timings["finish_s"] = time.monotonic() - t
        timings["step"] = "done"
