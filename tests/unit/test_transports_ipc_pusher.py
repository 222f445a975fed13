"""Pushing a module from GPU memory, on CPU tensors: the staged copy is the trainer's stall,
the checkpoint written from it (safetensors, the extras, the sidecar) is complete once it
exists and never overwritten, and the update is queued only after it (a fake updater client;
the CUDA IPC export is replaced by a handle naming the buffer)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from pool.checkpoint import read_manifest
from tests.unit.test_transports_ipc import Registry
from updater.transports.ipc import SIDECAR, IpcDescriptor, IpcStaging
from updater.transports.ipc import staging as staging_mod
from updater.transports.ipc.pusher import ModulePusher, write_checkpoint


class FakeClient:
    def __init__(self) -> None:
        self.pushed: list[tuple[Path, dict[str, Any]]] = []
        self.seen_complete: list[bool] = []

    def push(self, checkpoint: Path, **kw: Any) -> dict[str, Any]:
        self.seen_complete.append((checkpoint / SIDECAR).is_file())
        self.pushed.append((checkpoint, kw))
        return {"id": f"up-{len(self.pushed)}", "generation": len(self.pushed)}


@pytest.fixture(autouse=True)
def fake_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_mod, "export_buffer", Registry().export)


def test_a_checkpoint_written_from_the_staged_copy_is_complete_and_never_overwritten(
    tmp_path: Path,
) -> None:
    model = nn.Linear(4, 3)
    staging = IpcStaging(slots=1)
    copy = staging.stage(model, key="k")
    staged_weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # the trainer moves on: the checkpoint is the staged copy's
    path = tmp_path / "step-1"
    write_checkpoint(staging, copy, path, save_extra=lambda d: (d / "config.json").write_text("{}"))
    tensors = load_file(str(path / "model.safetensors"))
    assert torch.equal(tensors["weight"], staged_weight)
    assert {s.name for s in read_manifest(path).tensors} == {"weight", "bias"}
    desc = IpcDescriptor.model_validate_json((path / SIDECAR).read_text())
    assert desc.tag == copy.tag and (path / "config.json").is_file()
    assert not path.with_name("step-1.tmp").exists()
    with pytest.raises(FileExistsError):
        write_checkpoint(staging, copy, path)
    staging.stage(model, key="next")  # the slot is restaged: nothing is written from it
    with pytest.raises(LookupError):
        write_checkpoint(staging, copy, tmp_path / "step-2")
    assert not (tmp_path / "step-2").exists() and not (tmp_path / "step-2.tmp").exists()


def test_the_pusher_stages_now_and_queues_the_update_after_the_checkpoint(tmp_path: Path) -> None:
    client = FakeClient()
    pusher = ModulePusher(client, slots=2)  # type: ignore[arg-type]
    model = nn.Linear(4, 3)
    gate = threading.Event()

    def probe(ckpt: Path) -> tuple[list[int], list[int]]:
        gate.wait(5)
        return [1, 2], [3]

    staged = pusher.push(model, tmp_path / "step-1", probe=probe, step=1, label="r-step1")
    assert staged.stall_s >= 0 and not client.pushed  # queued only in the background
    gate.set()
    assert staged.record(timeout_s=10) == {"id": "up-1", "generation": 1}
    ckpt, kw = client.pushed[0]
    assert ckpt == tmp_path / "step-1" and client.seen_complete == [True]
    assert kw == {"probe": ([1, 2], [3]), "step": 1, "label": "r-step1", "trainer_run": ""}
    pusher.close()
