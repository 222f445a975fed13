"""``nccl_direct`` without a GPU: the server faked at the HTTP seam (vLLM's ``/collective_rpc``
calling RolloutPool's worker extension, with the real blocking: the init waits for the sender's
join, the receive for the data), the sender by a fake that records its typed commands. The real
data path (NCCL, the extension in vLLM 0.26 on a GPU) is in ``bench/gpu_update.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pool.checksum import Checksum, to_json
from pool.errors import AmbiguousMutation, DeadlineExceeded, PreflightFailed
from pool.evidence import ChecksumEvidence
from pool.types import TensorSpec
from tests.unit.test_transports_nccl import SPECS, FakeSender, FakeServer, SpecSource, target
from updater.deadline import bounded
from updater.transports.nccl import NcclConfig
from updater.transports.nccl.direct import NcclDirectTransport
from updater.transports.nccl.senders import Command, DirectInit, DirectSend, Rendezvous

SUMS = {s.name: Checksum(s.dtype, s.shape, i, 2 * i) for i, s in enumerate(SPECS)}


class DirectSender(FakeSender):
    """The fake sender, answering the direct path's commands as the real core would."""

    def run(self, command: Command[Any]) -> Any:
        match command:
            case DirectInit():
                self.commands.append(command)
                assert self.server.init_seen.wait(5), "server never got the init"
                return 0.01
            case DirectSend():
                self.commands.append(command)
                if self.hang:
                    self.unblock.wait(30)
                    raise RuntimeError("communicator aborted")
                assert self.server.update_seen.wait(5), "server never got the receive"
                self.server.data_sent.set()
                return {"send_s": 0.01, "checksum_s": 0.002, "checksums": to_json(SUMS)}
        return super().run(command)


def make(server: FakeServer, *, hang: bool = False, **cfg: Any) -> Any:
    import httpx

    from pool.engine import VllmEngine

    mock = httpx.MockTransport(server)
    sender = DirectSender(server, hang=hang)
    transport = NcclDirectTransport(
        NcclConfig(**cfg),
        SpecSource(),
        sender_impl=sender,
        http_transport=mock,
        local_version="0.26.0",
    )
    return transport, VllmEngine("http://replica.test", timeout=5.0, transport=mock), sender


def rpcs(server: FakeServer) -> list[tuple[str, dict[str, Any]]]:
    return [
        (b["method"], {k: json.loads(v) for k, v in b["kwargs"].items()})
        for _, p, b in server.requests
        if p == "/collective_rpc"
    ]


async def test_preflight_refuses_without_the_extension_or_with_another_layout() -> None:
    for layout, match in (
        (None, "worker-extension-cls"),
        ({s.name: [s.dtype, list(s.shape)] for s in SPECS[:2]}, "no runtime view"),
        ({s.name: ["float32", list(s.shape)] for s in SPECS}, "no runtime view"),
    ):
        server = FakeServer()
        server.layout = layout
        transport, engine, sender = make(server)
        with pytest.raises(PreflightFailed, match=match):
            await transport.preflight(engine, target())
        assert [m for m, _ in rpcs(server)] == ["rolloutpool_layout"] and sender.commands == []
        await engine.aclose()


async def test_direct_handshake_checksums_and_group_reuse() -> None:
    server = FakeServer()
    transport, engine, sender = make(server, master_address="10.0.0.7", master_port=31000)
    await transport.preflight(engine, target())
    ev = await transport.transfer(engine, target())
    assert ev.ok and ev.transport == "nccl_direct" and ev.checksums == SUMS
    assert ev.replica_checksums == SUMS and ev.checksum_s == 0.002
    assert ChecksumEvidence.compare(ev.checksums, ev.replica_checksums).proves_equal
    assert server.paths()[2:] == [
        "POST /collective_rpc",  # layout (preflight)
        "GET /is_paused",
        "GET /get_world_size",
        "POST /collective_rpc",  # direct_init
        "POST /collective_rpc",  # direct_receive: one HTTP call per transfer
    ]
    names = [[s.name, s.dtype, list(s.shape)] for s in SPECS]
    assert rpcs(server)[1:] == [
        (
            "rolloutpool_direct_init",
            {"master_address": "10.0.0.7", "master_port": 31000, "world_size": 2, "rank_offset": 1},
        ),
        (
            "rolloutpool_direct_receive",
            {"group": "10.0.0.7:31000", "names": names, "checksums": True},
        ),
    ]
    key = "http://replica.test#0"
    assert sender.commands[0] == DirectInit(Rendezvous(key, "10.0.0.7", 31000, 2))
    send = sender.commands[1]
    assert isinstance(send, DirectSend) and send.wire == tuple(s.name for s in SPECS)
    assert transport.last["http://replica.test"]["receive"] == {"received": 3}
    server.flip = SPECS[1].name  # a bit that changed on the way: the comparison fails
    server.rearm()
    flipped = await transport.transfer(engine, target())
    assert flipped.checksums is not None and flipped.replica_checksums is not None
    assert ChecksumEvidence.compare(flipped.checksums, flipped.replica_checksums).examples == (
        SPECS[1].name,
    )
    server.rearm()
    server.requests.clear()
    await transport.transfer(engine, target())
    assert [m for m, _ in rpcs(server)] == ["rolloutpool_direct_receive"]  # group reused
    await engine.aclose()


class CutTransport(NcclDirectTransport):
    """The negative control's fault: only the first 90 % of the tensors go on the wire."""

    def _plan(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        return specs[: len(specs) * 9 // 10]


async def test_a_cut_plan_still_carries_every_checksum() -> None:
    server = FakeServer()
    mock_t, engine, sender = make(server)
    cut = CutTransport(
        NcclConfig(),
        SpecSource(),
        sender_impl=sender,
        http_transport=mock_t._http_transport,
        local_version="0.26.0",
    )
    ev = await cut.transfer(engine, target())
    [(_, receive)] = [r for r in rpcs(server) if r[0] == "rolloutpool_direct_receive"]
    assert len(receive["names"]) == 2 and ev.checksums == SUMS
    assert ev.replica_checksums is not None
    gap = ChecksumEvidence.compare(ev.checksums, ev.replica_checksums)  # the validator sees the gap
    assert (gap.missing, gap.examples) == (1, (SPECS[2].name,))
    await engine.aclose()


async def test_stuck_receive_is_bounded_and_abandoned() -> None:
    server = FakeServer()
    transport, engine, sender = make(server, hang=True)
    with pytest.raises(DeadlineExceeded):
        await bounded("transfer", transport.transfer(engine, target()), 1.0, mutating=True)
    for _ in range(200):  # the abandoned task unwinds soon after the deadline (bounded wait)
        if sender.abandoned:
            break
        await asyncio.sleep(0.01)
    assert sender.abandoned == ["http://replica.test#0"]
    server.release.set()
    sender.unblock.set()
    server2 = FakeServer(fail={"/collective_rpc": 500})
    transport2, engine2, _ = make(server2, hang=True)
    with pytest.raises(AmbiguousMutation):
        await transport2.transfer(engine2, target())  # the group init failed ambiguously
    await engine.aclose()
    await engine2.aclose()
