"""RolloutPool's vLLM worker extension: checksums of the runtime weights, and a direct receive.

Loaded into every worker of a replica with vLLM's supported plug-in point (no vLLM patch)::

    vllm serve MODEL --worker-extension-cls pool.replica_extension.WeightExtension

(:attr:`pool.launcher.ReplicaSpec.extra_args`; the worker must be able to import ``pool``).
vLLM mixes the class into its worker class, so ``self`` below is the worker; each method is
called on every worker through ``POST /collective_rpc`` with keyword arguments as JSON strings,
and its return value (a dict) comes back as that worker's result. Each call runs inside the
engine loop and blocks it: call them on a paused engine (the LoRA checksums excepted: they read
a few KB).

* :meth:`WeightExtension.rolloutpool_layout` — the runtime weights by *checkpoint* tensor name,
  ``{name: [dtype, shape]}``: the read-only plan a sender checks before sending.
* :meth:`WeightExtension.rolloutpool_checksums` — :mod:`pool.checksum` checksums over the
  runtime parameters, by checkpoint name.
* :meth:`WeightExtension.rolloutpool_lora_checksums` — the same over the factors of every LoRA
  adapter the worker holds, to compare with :mod:`pool.adapter_sums` (runs on a serving engine).
* :meth:`WeightExtension.rolloutpool_direct_init` / ``_direct_receive`` / ``_direct_close`` —
  the receiving side of the ``nccl_direct`` transport: join an NCCL group with the sender
  (rank 0) and broadcast each tensor straight into the runtime parameter (no staging buffer, no
  ``load_weights``). GPU only.
* :meth:`WeightExtension.rolloutpool_ipc_check` / ``_ipc_copy`` / ``_ipc_close`` — the
  receiving side of the ``ipc_direct`` transport: open the sender's staging buffer by its CUDA
  IPC handle (:mod:`pool.ipc_handles`, once per buffer) and copy each staged tensor into its
  runtime parameter on this GPU (:mod:`pool.ipc_copy`). GPU only.

**Layout.** vLLM fuses some checkpoint tensors into one runtime parameter (``q_proj``,
``k_proj``, ``v_proj`` -> ``qkv_proj``; ``gate_proj``, ``up_proj`` -> ``gate_up_proj``; the
model's ``packed_modules_mapping``, sizes from the layer's ``output_sizes``). Each checkpoint
tensor is a contiguous block of rows of the fused parameter, so a *view* of those rows is named
after the checkpoint tensor: checksums are computed, and direct broadcasts land, on exactly the
bytes the checkpoint tensor holds. A vocabulary padded past ``org_vocab_size`` is viewed without
the padding rows. On CPU, vLLM repacks linear weights for oneDNN and leaves an empty
``weight``; such a weight is recovered exactly by applying the layer to an identity matrix
(``I @ W.T`` adds only exact zeros to each weight), then transposed back.

**Tensor parallel** (TP > 1, pipeline parallel 1): each worker holds shards of the checkpoint
tensors (:mod:`pool.shards` says which slice lands in which block of which parameter). The layout
then reports the *full* checkpoint shapes (what a sender sends) and each rank's slice under
``"shards"``; the direct receive takes each sharded tensor whole into a staging buffer and copies
the rank's slice into the runtime parameter (a tensor every rank holds whole lands in place), and
its checksums are over the rank's slice, named ``"<name>@tp<rank>"``. ``rolloutpool_checksums``
stays TP=1 only. Pipeline parallel is refused. Names the mapping does not know are reported under
their runtime name, so a sender's comparison fails closed.

Imports: ``torch``, ``vllm`` (inside methods) and :mod:`pool.checksum`; nothing that vLLM's
worker does not already have.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pool.checksum import Pending, tensor_checksums, to_json
from pool.ipc_copy import Prepared, plan
from pool.ipc_handles import Entry, IpcHandle, open_buffer, read_tag, resolve_device
from pool.shards import Piece, tp_pieces

__all__ = ["WeightExtension", "runtime_views"]

_IPC_PLANS = 4  #: copy plans a worker keeps (one per staging slot and rank in use)


def _torch() -> Any:
    import torch

    return torch


def _nbytes(torch: Any, dtype: str, shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * int(torch.empty((), dtype=getattr(torch, dtype)).element_size())


def _open_ipc(h: IpcHandle) -> tuple[Any, str]:
    """Open ``h`` from this worker's current GPU: ``(buffer, "")`` or ``(None, why)`` (an
    unreachable GPU, or CUDA refusing the handle, e.g. because its owner exited)."""
    current = int(_torch().cuda.current_device())
    index, why = resolve_device(h.device_uuid, current)
    if index is None:
        return None, f"unreachable staging buffer: {why}"
    try:
        return open_buffer(h, index), ""
    except Exception as e:  # cudaIpcOpenMemHandle's error, whatever torch wraps it in
        return None, f"cannot open the staging buffer: {type(e).__name__}: {e}"


def _addresses(model: Any) -> tuple[int, ...]:
    """Where every parameter of ``model`` lives now (a kept copy plan is valid while this is
    unchanged: it holds views of these storages)."""
    return tuple(int(p.data_ptr()) for p in model.parameters())


def _recovered_cpu_weight(torch: Any, module: Any, weight: Any) -> Any:
    """A CPU linear weight vLLM repacked (``weight`` left empty): ``layer(I).T``, exact."""
    k = int(module.input_size_per_partition)
    with torch.no_grad():
        eye = torch.eye(k, dtype=weight.dtype)
        out = module.cpu_linear(eye, weight, None)
    return out.t().contiguous()


def runtime_views(model: Any, *, writable: bool) -> dict[str, Any]:
    """The model's weights by checkpoint tensor name (see the module docstring): views of the
    runtime parameters, or (``writable=False`` on CPU) exact recoveries of repacked ones.
    ``writable=True`` refuses (``RuntimeError``) where a name has no writable view."""
    torch = _torch()
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for pname, param in model.named_parameters():
        mod_name, _, leaf = pname.rpartition(".")
        module = modules.get(mod_name)
        tensor = param.data
        if tensor.numel() == 0 and leaf == "weight" and hasattr(module, "cpu_linear"):
            if writable:
                raise RuntimeError(f"{pname} is repacked (CPU): no writable view")
            tensor = _recovered_cpu_weight(torch, module, tensor)
        org = getattr(module, "org_vocab_size", None)
        if isinstance(org, int) and tensor.dim() >= 1 and tensor.shape[0] > org:
            tensor = tensor[:org]  # the padding rows of a vocabulary hold nothing sent
        parent, _, short = mod_name.rpartition(".")
        parts = packed.get(short)
        sizes = getattr(module, "output_sizes", None)
        if parts and leaf in ("weight", "bias") and sizes and len(sizes) == len(parts):
            if sum(sizes) != tensor.shape[0]:
                raise RuntimeError(f"{pname}: rows {tensor.shape[0]} != sum{list(sizes)}")
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                name = f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}"
                out[name] = tensor[start : start + int(size)]
                start += int(size)
        else:
            out[pname] = tensor
    return out


class WeightExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (see the module docstring).
    Every attribute is prefixed ``rolloutpool_``: vLLM refuses an extension whose names clash
    with the worker's."""

    # -- helpers (not called over RPC) ---------------------------------------------------------

    def _rolloutpool_model(self) -> Any:
        runner: Any = getattr(self, "model_runner")  # noqa: B009 - set by vLLM's worker
        return runner.get_model()

    def _rolloutpool_tp(self, *, sharded_ok: bool) -> tuple[int, int]:
        """``(tp_rank, tp_size)`` of this worker; refuses PP > 1, and TP > 1 unless
        ``sharded_ok``."""
        cfg: Any = getattr(self, "parallel_config", None)
        if cfg is None:
            cfg = getattr(self, "vllm_config").parallel_config  # noqa: B009
        tp = int(getattr(cfg, "tensor_parallel_size", 1))
        pp = int(getattr(cfg, "pipeline_parallel_size", 1))
        if pp != 1 or (tp != 1 and not sharded_ok):
            mapped = "TP>=1 with PP=1" if sharded_ok else "only TP=PP=1"
            raise RuntimeError(f"rolloutpool extension: TP={tp} PP={pp}; {mapped} is mapped")
        # with PP = 1 the worker's rank within the replica is its tensor-parallel rank
        return int(getattr(self, "rank", 0)) % tp, tp

    # -- read-only ------------------------------------------------------------------------------

    def rolloutpool_layout(self) -> dict[str, Any]:
        """``{"layout": {checkpoint name: [dtype, shape]}, "device": str}``; with TP > 1 the
        full shapes, plus ``"shards": {name: [dim, start, length]}`` (the slice of each sharded
        tensor this rank holds), ``"tp_rank"`` and ``"tp_size"``."""
        rank, size = self._rolloutpool_tp(sharded_ok=True)
        if size > 1:
            pieces = tp_pieces(self._rolloutpool_model(), rank, size)
            return {
                "layout": {n: [p.dtype, list(p.shape)] for n, p in pieces.items()},
                "shards": {n: list(p.slice) for n, p in pieces.items() if p.slice is not None},
                "tp_rank": rank,
                "tp_size": size,
                "device": str(next(iter(pieces.values())).view.device) if pieces else "none",
            }
        views = runtime_views(self._rolloutpool_model(), writable=False)
        layout = {
            n: [str(t.dtype).rsplit(".", 1)[-1], [int(d) for d in t.shape]]
            for n, t in views.items()
        }
        device = str(next(iter(views.values())).device) if views else "none"
        return {"layout": layout, "device": device}

    def rolloutpool_checksums(self) -> dict[str, Any]:
        """``{"checksums": {checkpoint name: [dtype, shape, plain, weighted]}, "elapsed_s"}``:
        :mod:`pool.checksum` over the runtime parameters as they are now (one host sync).
        TP = PP = 1 only."""
        self._rolloutpool_tp(sharded_ok=False)
        t0 = time.perf_counter()
        views = runtime_views(self._rolloutpool_model(), writable=False)
        sums = tensor_checksums(views.items())
        return {"checksums": to_json(sums), "elapsed_s": time.perf_counter() - t0}

    def rolloutpool_lora_checksums(self) -> dict[str, Any]:
        """``{"adapters": {vLLM's adapter id: {name: checksum}}, "elapsed_s"}``:
        :mod:`pool.checksum` over the factors of every LoRA adapter this worker holds, as it
        holds them (served dtype, scaling in ``lora_B``), named as :mod:`pool.adapter_sums`
        names them: a packed module's factors (``qkv_proj``) under the modules it packs. Reads
        a few KB per module, so it may run on a serving engine. TP = PP = 1 only; raises where
        LoRA is not enabled."""
        self._rolloutpool_tp(sharded_ok=False)
        t0 = time.perf_counter()
        runner: Any = getattr(self, "model_runner")  # noqa: B009 - set by vLLM's worker
        workers = getattr(runner, "lora_manager", None)
        if workers is None:
            raise RuntimeError("LoRA is not enabled on this replica (--enable-lora)")
        manager = workers._adapter_manager  # vLLM's LoRAModelManager: no public accessor
        packed: dict[str, list[str]] = dict(manager.packed_modules_mapping)
        out: dict[str, Any] = {}
        for adapter_id, adapter in manager.list_adapters().items():
            named: list[tuple[str, Any]] = []
            for module, w in adapter.loras.items():
                prefix, _, leaf = module.rpartition(".")
                if isinstance(w.lora_a, list):  # packed: one factor pair per packed module
                    subs = packed.get(leaf, [])
                    for sub, a, b in zip(subs, w.lora_a, w.lora_b, strict=False):
                        if a is not None:
                            named += [(f"{prefix}.{sub}.lora_A", a), (f"{prefix}.{sub}.lora_B", b)]
                else:
                    named += [(f"{module}.lora_A", w.lora_a), (f"{module}.lora_B", w.lora_b)]
            out[str(adapter_id)] = to_json(tensor_checksums(named))
        return {"adapters": out, "elapsed_s": time.perf_counter() - t0}

    # -- the direct receive (GPU) ----------------------------------------------------------------

    def _rolloutpool_comms(self) -> dict[str, Any]:
        comms: dict[str, Any] | None = getattr(self, "_rolloutpool_groups", None)
        if comms is None:
            comms = {}
            self._rolloutpool_groups = comms
        return comms

    def rolloutpool_direct_init(
        self, master_address: str, master_port: str, world_size: str, rank_offset: str
    ) -> dict[str, Any]:
        """Join the sender's NCCL group (the sender is rank 0 and hosts the rendezvous store at
        ``master_address:master_port``, which also names the group here; a group held under
        that name is aborted first). Groups of several senders may coexist. Blocks until every
        rank joined (vLLM's store timeout, 300 s, bounds the rendezvous). With TP > 1 every
        worker joins, as rank ``rank_offset`` + its own rank."""
        self._rolloutpool_tp(sharded_ok=True)
        torch = _torch()
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        host, port = json.loads(master_address), int(json.loads(master_port))
        group = f"{host}:{port}"
        self.rolloutpool_direct_close(json.dumps(group))
        t0 = time.perf_counter()
        rank = int(json.loads(rank_offset)) + int(getattr(self, "rank", 0))
        pg = StatelessProcessGroup.create(
            host=host, port=port, rank=rank, world_size=int(json.loads(world_size))
        )
        device = torch.device("cuda", torch.cuda.current_device())
        self._rolloutpool_comms()[group] = PyNcclCommunicator(pg, device=device)
        return {"group": group, "rank": rank, "init_s": time.perf_counter() - t0}

    def _rolloutpool_pieces(self, plan: list[Any], rank: int, size: int) -> list[Piece]:
        """The landing place of every ``[name, dtype, shape]`` of ``plan``, resolved before
        anything is received: a contiguous runtime view (TP=1), or a rank's :class:`Piece`
        (TP > 1); ``RuntimeError`` for a name with none or another dtype / full shape."""
        model = self._rolloutpool_model()
        if size > 1:
            pieces = tp_pieces(model, rank, size)
        else:
            views = runtime_views(model, writable=True)
            pieces = {
                n: Piece(tuple(int(d) for d in v.shape), str(v.dtype).rsplit(".", 1)[-1], v, None)
                for n, v in views.items()
            }
        out = []
        for name, dtype, shape in plan:
            piece = pieces.get(name)
            if piece is None:
                raise RuntimeError(f"no runtime parameter for {name!r}")
            got = [piece.dtype, list(piece.shape)]
            if got != [dtype, list(shape)] or not piece.view.is_contiguous():
                raise RuntimeError(f"{name}: runtime {got} contiguous={piece.view.is_contiguous()}")
            out.append(piece)
        return out

    def rolloutpool_direct_receive(
        self, group: str, names: str, checksums: str = "false", timeout_s: str = "null"
    ) -> dict[str, Any]:
        """Receive ``names`` (a JSON list of ``[checkpoint name, dtype, shape]`` in the
        sender's order) over ``group`` (``"address:port"`` of its init) by one NCCL broadcast
        each, straight into the runtime parameters (TP > 1: a sharded tensor into a staging
        buffer, then the rank's slice into its parameter block, on the same stream). Every
        name is resolved *before* the first broadcast (a refusal leaves the weights untouched,
        and the sender's broadcast stuck until the sender abandons the group). Blocks until
        all data arrived, or (``timeout_s``, JSON seconds) until that deadline: then the group
        is aborted here (``ncclCommAbort``; the weights are partly written) and the call
        fails, which frees the engine loop for another transfer.

        ``checksums`` (JSON ``true``): also the :mod:`pool.checksum` checksums of every
        parameter received (TP > 1: of the rank's slice, named ``"<name>@tp<rank>"``), each
        computed over the runtime view right after its data landed (on a second stream,
        ordered after that broadcast by an event, so it overlaps the rest of the transfer),
        returned under ``"checksums"``: the replica's side of the comparison without a second
        call in the paused window."""
        rank, size = self._rolloutpool_tp(sharded_ok=True)
        torch = _torch()
        name_of_group = json.loads(group)
        comm = self._rolloutpool_comms().get(name_of_group)
        if comm is None:
            raise RuntimeError(f"no group {name_of_group!r}: rolloutpool_direct_init first")
        plan = json.loads(names)
        deadline_s = json.loads(timeout_s)
        pieces = self._rolloutpool_pieces(plan, rank, size)
        stream = torch.cuda.current_stream()
        staged = [p for p in pieces if p.slice is not None]
        staging = None
        if staged:
            most = max(_nbytes(torch, p.dtype, p.shape) for p in staged)
            staging = torch.empty(most, dtype=torch.uint8, device=pieces[0].view.device)
        pending = Pending() if json.loads(checksums) else None
        sum_stream = torch.cuda.Stream() if pending is not None else None
        wire = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            for (name, _, _), piece in zip(plan, pieces, strict=True):
                nbytes = _nbytes(torch, piece.dtype, piece.shape)
                wire += nbytes
                if piece.slice is None:
                    comm.broadcast(piece.view, src=0, stream=stream)
                else:
                    assert staging is not None
                    full = staging[:nbytes].view(getattr(torch, piece.dtype)).view(piece.shape)
                    comm.broadcast(full, src=0, stream=stream)
                    piece.view.copy_(piece.source(full))
                if pending is not None and sum_stream is not None:
                    landed = torch.cuda.Event()
                    landed.record(stream)
                    sum_stream.wait_event(landed)
                    with torch.cuda.stream(sum_stream):
                        pending.add(f"{name}@tp{rank}" if size > 1 else name, piece.view)
        self._rolloutpool_wait(stream, name_of_group, deadline_s, t0)
        out: dict[str, Any] = {"received": len(pieces), "receive_s": time.perf_counter() - t0}
        out["bytes"] = wire
        if size > 1:
            out["tp_rank"] = rank
        if pending is not None and sum_stream is not None:
            with torch.cuda.stream(sum_stream):
                out["checksums"] = to_json(pending.collect())
            out["checksum_wait_s"] = time.perf_counter() - t0 - out["receive_s"]
        return out

    def _rolloutpool_wait(
        self, stream: Any, group: str, deadline_s: float | None, t0: float
    ) -> None:
        """Wait for ``stream``; past ``deadline_s`` seconds after ``t0``, abort ``group`` and
        raise."""
        if deadline_s is None:
            stream.synchronize()
            return
        done = _torch().cuda.Event()
        done.record(stream)
        while not done.query():
            if time.perf_counter() - t0 > float(deadline_s):
                self.rolloutpool_direct_close(json.dumps(group))
                raise RuntimeError(
                    f"receive over {group} not done after {deadline_s} s: group aborted"
                )
            time.sleep(0.0005)

    def rolloutpool_direct_close(self, group: str = "null") -> dict[str, Any]:
        """Drop a group joined by :meth:`rolloutpool_direct_init` (``ncclCommAbort``): the one
        named ``group``, or every one (``null``)."""
        comms = self._rolloutpool_comms()
        name = json.loads(group)
        closing = list(comms) if name is None else [name] if name in comms else []
        for key in closing:
            comms.pop(key).destroy()
        return {"closed": closing}

    # -- ipc_direct (GPU) ------------------------------------------------------------------------

    def _rolloutpool_ipc_source(self, handle: str) -> tuple[Any, str]:
        """The staging buffer ``handle`` (JSON :class:`~pool.ipc_handles.IpcHandle`) names,
        opened once and kept: ``(buffer, "")``, or ``(None, why)`` where its GPU cannot be
        reached from this worker's or the handle cannot be opened (nothing was written)."""
        opened: dict[Any, Any] | None = getattr(self, "_rolloutpool_ipc_opened", None)
        if opened is None:
            opened = {}
            self._rolloutpool_ipc_opened = opened
        try:
            h = IpcHandle.from_json(json.loads(handle))
        except ValueError as e:
            return None, str(e)
        if h.key not in opened:
            buffer, why = _open_ipc(h)
            if buffer is None:
                return None, why
            opened[h.key] = buffer
        return opened[h.key], ""

    def rolloutpool_ipc_check(self, buffer: str, tag: str) -> dict[str, Any]:
        """Read-only: can this worker reach the staging buffer ``buffer`` (JSON handle) and
        does it hold the copy ``tag`` (JSON int)? ``{"ok": true, "device", "peer"}`` or
        ``{"ok": false, "refused": why}``. Opens (and keeps) the handle."""
        src, why = self._rolloutpool_ipc_source(buffer)
        if src is None:
            return {"ok": False, "refused": why}
        got, want = read_tag(src), int(json.loads(tag))
        if got != want:
            return {"ok": False, "refused": f"the staging buffer holds copy {got}, not {want}"}
        peer = src.device.type == "cuda" and src.device.index != _torch().cuda.current_device()
        return {"ok": True, "device": str(src.device), "peer": bool(peer)}

    def rolloutpool_ipc_copy(
        self, buffer: str, entries: str, tag: str, checksums: str = "true"
    ) -> dict[str, Any]:
        """Copy the staged copy ``tag`` (JSON int) of ``buffer`` (JSON handle) into the runtime
        parameters: ``entries`` is a JSON list of :class:`~pool.ipc_handles.Entry` (checkpoint
        names; TP > 1: each rank copies its slice of the full staged tensor).

        Refusals happen before anything is written and are *answered*, not raised:
        ``{"refused": why}`` for a name with no runtime view of that dtype and full shape, an
        unreachable or unopenable buffer, or a buffer that no longer holds ``tag``. Once the
        copies began, a failure raises (the weights are partly written), and so does a buffer
        whose tag changed by the end of the copy (rewritten meanwhile: torn). ``checksums``
        (JSON ``true``): the :mod:`pool.checksum` checksums of every piece copied (of the words
        written: :mod:`pool.ipc_copy`), under ``"checksums"`` as one JSON string of
        :func:`~pool.checksum.to_json` (TP > 1: ``"<name>@tp<rank>"``).

        The plan (:class:`pool.ipc_copy.Prepared`: names resolved, views built, the checksum
        batch) is kept per ``(buffer, entries, rank)`` and reused while every runtime parameter
        is still at the address it had when the plan was made (else, and after
        :meth:`rolloutpool_ipc_close`, it is made again, refusals included). Timings: ``plan_s``
        (``plan_cached``), :meth:`~pool.ipc_copy.Prepared.run`'s, and ``worker_s`` (the whole
        call in this worker)."""
        t0 = time.perf_counter()
        rank, size = self._rolloutpool_tp(sharded_ok=True)
        cache = self._rolloutpool_ipc_plans()
        where = _addresses(self._rolloutpool_model())
        key = (buffer, entries, rank, size)
        hit = cache.get(key)
        if hit is not None and hit[0] != where:
            cache.clear()  # the parameters moved: every plan points at old storage
            hit = None
        if hit is None or self._rolloutpool_ipc_source(buffer)[0] is not hit[1].buffer:
            made = self._rolloutpool_ipc_plan(buffer, entries, rank, size)
            if isinstance(made, str):
                return {"refused": made, "tp_rank": rank}
            cache.pop(key, None)
            while len(cache) >= _IPC_PLANS:
                cache.pop(next(iter(cache)))
            cache[key] = (where, made)
            prepared, cached = made, False
        else:
            prepared, cached = hit[1], True
        plan_s = time.perf_counter() - t0
        want = int(json.loads(tag))
        if read_tag(prepared.buffer) != want:
            return {"refused": f"the staging buffer no longer holds copy {want}", "tp_rank": rank}
        out = prepared.run(checksums=bool(json.loads(checksums)))
        if read_tag(prepared.buffer) != want:
            raise RuntimeError(f"the staging buffer changed during the copy of {want}: torn")
        if "checksums" in out:  # one string: each hop of vLLM's RPC path re-encodes objects
            out["checksums"] = json.dumps(out["checksums"])
        out.update(
            received=len(prepared.named),
            tp_rank=rank,
            plan_s=plan_s,
            plan_cached=cached,
            worker_s=time.perf_counter() - t0,
        )
        return out

    def _rolloutpool_ipc_plans(self) -> dict[Any, tuple[tuple[int, ...], Prepared]]:
        plans: dict[Any, tuple[tuple[int, ...], Prepared]] | None = getattr(
            self, "_rolloutpool_ipc_kept", None
        )
        if plans is None:
            plans = {}
            self._rolloutpool_ipc_kept = plans
        return plans

    def _rolloutpool_ipc_plan(
        self, buffer: str, entries: str, rank: int, size: int
    ) -> Prepared | str:
        """A new plan for :meth:`rolloutpool_ipc_copy`, or why it is refused (read-only)."""
        ents = [Entry.from_json(e) for e in json.loads(entries)]
        try:
            pieces = self._rolloutpool_pieces(
                [[e.name, e.dtype, list(e.shape)] for e in ents], rank, size
            )
        except RuntimeError as e:
            return str(e)
        src, why = self._rolloutpool_ipc_source(buffer)
        if src is None:
            return why
        end = max((e.offset + e.nbytes for e in ents), default=0)
        if end > int(src.numel()):
            return f"entries end at byte {end}, past the buffer"
        names = [f"{e.name}@tp{rank}" if size > 1 else e.name for e in ents]
        return Prepared(src, plan(ents, pieces, names))

    def rolloutpool_ipc_close(self) -> dict[str, Any]:
        """Drop every staging buffer this worker opened, and the plans that view them (their
        owners may then free them)."""
        opened: dict[Any, Any] = getattr(self, "_rolloutpool_ipc_opened", None) or {}
        n = len(opened)
        opened.clear()
        self._rolloutpool_ipc_plans().clear()
        return {"closed": n}
