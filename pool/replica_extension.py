"""RolloutPool's vLLM worker extension: checksums of the runtime weights, and a direct receive.

Loaded into every worker of a replica with vLLM's supported plug-in point (no vLLM patch)::

    vllm serve MODEL --worker-extension-cls pool.replica_extension.WeightExtension

(:attr:`pool.launcher.ReplicaSpec.extra_args`; the worker must be able to import ``pool``).
vLLM mixes the class into its worker class, so ``self`` below is the worker; each method is
called on every worker through ``POST /collective_rpc`` with keyword arguments as JSON strings,
and its return value (a dict) comes back as that worker's result. Each call runs inside the
engine loop and blocks it: call them on a paused engine.

* :meth:`WeightExtension.rolloutpool_layout` — the runtime weights by *checkpoint* tensor name,
  ``{name: [dtype, shape]}``: the read-only plan a sender checks before sending.
* :meth:`WeightExtension.rolloutpool_checksums` — :mod:`pool.checksum` checksums over the
  runtime parameters, by checkpoint name.
* :meth:`WeightExtension.rolloutpool_direct_init` / ``_direct_receive`` / ``_direct_close`` —
  the receiving side of the ``nccl_direct`` transport: join an NCCL group with the sender
  (rank 0) and broadcast each tensor straight into the runtime parameter (no staging buffer, no
  ``load_weights``). GPU only.

**Layout.** vLLM fuses some checkpoint tensors into one runtime parameter (``q_proj``,
``k_proj``, ``v_proj`` -> ``qkv_proj``; ``gate_proj``, ``up_proj`` -> ``gate_up_proj``; the
model's ``packed_modules_mapping``, sizes from the layer's ``output_sizes``). Each checkpoint
tensor is a contiguous block of rows of the fused parameter, so a *view* of those rows is named
after the checkpoint tensor: checksums are computed, and direct broadcasts land, on exactly the
bytes the checkpoint tensor holds. A vocabulary padded past ``org_vocab_size`` is viewed without
the padding rows. On CPU, vLLM repacks linear weights for oneDNN and leaves an empty
``weight``; such a weight is recovered exactly by applying the layer to an identity matrix
(``I @ W.T`` adds only exact zeros to each weight), then transposed back.

**Scope.** One worker per replica (tensor and pipeline parallel size 1): with TP > 1 each worker
holds shards, which neither method maps (they refuse). Names the mapping does not know are
reported under their runtime name, so a sender's comparison fails closed.

Imports: ``torch``, ``vllm`` (inside methods) and :mod:`pool.checksum`; nothing that vLLM's
worker does not already have.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pool.checksum import Pending, tensor_checksums, to_json

__all__ = ["WeightExtension", "runtime_views"]


def _torch() -> Any:
    import torch

    return torch


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

    def _rolloutpool_check_single(self) -> None:
        cfg: Any = getattr(self, "parallel_config", None)
        if cfg is None:
            cfg = getattr(self, "vllm_config").parallel_config  # noqa: B009
        tp = int(getattr(cfg, "tensor_parallel_size", 1))
        pp = int(getattr(cfg, "pipeline_parallel_size", 1))
        if tp != 1 or pp != 1:
            raise RuntimeError(f"rolloutpool extension: TP={tp} PP={pp}; only TP=PP=1 is mapped")

    # -- read-only ------------------------------------------------------------------------------

    def rolloutpool_layout(self) -> dict[str, Any]:
        """``{"layout": {checkpoint name: [dtype, shape]}, "device": str}``."""
        self._rolloutpool_check_single()
        views = runtime_views(self._rolloutpool_model(), writable=False)
        layout = {
            n: [str(t.dtype).rsplit(".", 1)[-1], [int(d) for d in t.shape]]
            for n, t in views.items()
        }
        device = str(next(iter(views.values())).device) if views else "none"
        return {"layout": layout, "device": device}

    def rolloutpool_checksums(self) -> dict[str, Any]:
        """``{"checksums": {checkpoint name: [dtype, shape, plain, weighted]}, "elapsed_s"}``:
        :mod:`pool.checksum` over the runtime parameters as they are now (one host sync)."""
        self._rolloutpool_check_single()
        t0 = time.perf_counter()
        views = runtime_views(self._rolloutpool_model(), writable=False)
        sums = tensor_checksums(views.items())
        return {"checksums": to_json(sums), "elapsed_s": time.perf_counter() - t0}

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
        rank joined (vLLM's store timeout, 300 s, bounds the rendezvous)."""
        self._rolloutpool_check_single()
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

    def rolloutpool_direct_receive(
        self, group: str, names: str, checksums: str = "false"
    ) -> dict[str, Any]:
        """Receive ``names`` (a JSON list of ``[checkpoint name, dtype, shape]`` in the
        sender's order) over ``group`` (``"address:port"`` of its init) by one NCCL broadcast
        each, straight into the runtime parameters. Every name is resolved to a contiguous
        view of equal dtype and shape *before* the first broadcast (a refusal leaves the
        weights untouched, and the sender's broadcast stuck until the sender abandons the
        group). Blocks until all data arrived.

        ``checksums`` (JSON ``true``): also the :mod:`pool.checksum` checksums of every
        parameter received, each computed over the runtime view right after its data landed
        (on a second stream, ordered after that broadcast by an event, so it overlaps the
        rest of the transfer), returned under ``"checksums"``: the replica's side of the
        comparison without a second call in the paused window."""
        self._rolloutpool_check_single()
        torch = _torch()
        comm = self._rolloutpool_comms().get(json.loads(group))
        if comm is None:
            raise RuntimeError(f"no group {json.loads(group)!r}: rolloutpool_direct_init first")
        plan = json.loads(names)
        views = runtime_views(self._rolloutpool_model(), writable=True)
        dsts = []
        for name, dtype, shape in plan:
            view = views.get(name)
            if view is None:
                raise RuntimeError(f"no runtime parameter for {name!r}")
            got = [str(view.dtype).rsplit(".", 1)[-1], [int(d) for d in view.shape]]
            if got != [dtype, list(shape)] or not view.is_contiguous():
                raise RuntimeError(f"{name}: runtime {got} contiguous={view.is_contiguous()}")
            dsts.append(view)
        stream = torch.cuda.current_stream()
        pending = Pending() if json.loads(checksums) else None
        sum_stream = torch.cuda.Stream() if pending is not None else None
        t0 = time.perf_counter()
        with torch.no_grad():
            for (name, _, _), view in zip(plan, dsts, strict=True):
                comm.broadcast(view, src=0, stream=stream)
                if pending is not None and sum_stream is not None:
                    landed = torch.cuda.Event()
                    landed.record(stream)
                    sum_stream.wait_event(landed)
                    with torch.cuda.stream(sum_stream):
                        pending.add(name, view)
        stream.synchronize()
        out: dict[str, Any] = {"received": len(dsts), "receive_s": time.perf_counter() - t0}
        out["bytes"] = sum(v.numel() * v.element_size() for v in dsts)
        if pending is not None and sum_stream is not None:
            with torch.cuda.stream(sum_stream):
                out["checksums"] = to_json(pending.collect())
            out["checksum_wait_s"] = time.perf_counter() - t0 - out["receive_s"]
        return out

    def rolloutpool_direct_close(self, group: str = "null") -> dict[str, Any]:
        """Drop a group joined by :meth:`rolloutpool_direct_init` (``ncclCommAbort``): the one
        named ``group``, or every one (``null``)."""
        comms = self._rolloutpool_comms()
        name = json.loads(group)
        closing = list(comms) if name is None else [name] if name in comms else []
        for key in closing:
            comms.pop(key).destroy()
        return {"closed": closing}
