"""CUDA IPC of a staging buffer between two processes on one GPU, without vLLM.

The sender (this process) stages tensors (:class:`~updater.transports.ipc.IpcStaging`) and
exports the slot's handle as JSON (:mod:`pool.ipc_handles`); a spawned child opens it by the
GPU's UUID, checks the tag, copies every entry into tensors of its own
(:mod:`pool.ipc_copy`) and returns their checksums (the copy kernel of :mod:`pool.ipc_sums`
copies and checksums every entry in one pass, trusted after its self-test), which must equal
the sender's. A GPU the
child cannot see is refused before anything is opened. Seconds; run on the
GPU host first (``tests/gpu/README.md``), before ``bench/gpu_ipc.py``.
"""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def _child(handle: dict[str, Any], entries: list[list[Any]], tag: int, out: Any) -> None:
    import torch

    from pool.checksum import from_json
    from pool.ipc_copy import Prepared, plan
    from pool.ipc_handles import Entry, IpcHandle, open_buffer, read_tag, resolve_device
    from pool.shards import Piece

    h = IpcHandle.from_json(handle)
    index, why = resolve_device(h.device_uuid, torch.cuda.current_device())
    assert index is not None, why
    buf = open_buffer(h, index)
    assert read_tag(buf) == tag
    ents = [Entry.from_json(e) for e in entries]
    fused = torch.empty(sum(e.nbytes for e in ents), dtype=torch.uint8, device="cuda")
    pieces, at = [], 0
    for e in ents:  # one runtime "parameter" holding every entry back to back
        view = fused[at : at + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        pieces.append(Piece(e.shape, e.dtype, view, None))
        at += e.nbytes
    got = Prepared(buf, plan(ents, pieces, [e.name for e in ents])).run(checksums=True)
    keys = ("checksums", "copies", "checksum_kernel", "fused", "copy_gpu_s")
    out.put({k: got.get(k) for k in keys})
    assert from_json(got["checksums"])


def test_a_spawned_process_copies_the_staged_copy_bit_exact() -> None:
    import torch

    from pool.checksum import from_json, to_json
    from pool.ipc_handles import resolve_device
    from updater.transports.ipc import IpcStaging

    g = torch.Generator(device="cuda").manual_seed(0)
    named = [
        (f"t{i}", torch.randn(512, 256, generator=g, device="cuda").bfloat16()) for i in range(6)
    ]
    staging = IpcStaging(slots=1)
    copy = staging.stage(named, key="k")
    desc = staging.descriptor(copy)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(desc.handle, desc.entries, desc.tag, q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert got["checksum_kernel"] == "copy" and got["fused"] == len(named)
    assert from_json(got["checksums"]) == from_json(
        json.loads(json.dumps(to_json(staging.checksums(copy))))
    )
    assert got["copies"] == 1  # consecutive in the buffer and in one parameter
    assert resolve_device("GPU-00000000-0000-0000-0000-000000000000", 0)[0] is None


if __name__ == "__main__":
    test_a_spawned_process_copies_the_staged_copy_bit_exact()
    print("ok")
