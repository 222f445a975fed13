"""``nccl_direct`` waves and tensor-parallel replicas without a GPU: several replicas faked at
the HTTP seam (vLLM's ``/collective_rpc`` into RolloutPool's worker extension, with the real
blocking: a group init waits for every rank of the group, a receive for the broadcast), the
sender by a fake that records its typed commands and 'broadcasts' only once every member of
the group asked to receive. The real data path (NCCL on 4 GPUs) is ``bench/gpu_waves.py``."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest

from pool.checksum import Checksum, to_json
from pool.engine import VllmEngine
from pool.errors import PreflightFailed
from pool.evidence import ChecksumEvidence
from tests.unit.test_transports_nccl import SPECS, SpecSource, target
from updater.transports.nccl import NcclConfig, Sender
from updater.transports.nccl.direct import NcclDirectTransport
from updater.transports.nccl.senders import Command, DirectInit, DirectSend, shard_key

SUMS = {s.name: Checksum(s.dtype, s.shape, i, 2 * i) for i, s in enumerate(SPECS)}
SHARDED = SPECS[1].name  # (8, 8): rank r of a TP=2 replica holds rows [4r, 4r + 4)


def shard_sum(rank: int) -> Checksum:
    return Checksum("bfloat16", (4, 8), 100 + rank, 200 + rank)


class Group:
    """One NCCL group as the fakes see it: who joined, who is receiving."""

    def __init__(self) -> None:
        self.joined: set[str] = set()
        self.receiving: set[str] = set()
        self.cond = threading.Condition()
        self.sent = threading.Event()

    def wait_for(self, what: set[str], members: set[str], timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: members <= what, timeout)

    def add(self, what: set[str], url: str) -> None:
        with self.cond:
            what.add(url)
            self.cond.notify_all()


class Fabric:
    """The replicas' fake servers and the groups between them and the sender, by port."""

    def __init__(self) -> None:
        self.groups: dict[int, Group] = {}
        self.members: dict[int, set[str]] = {}
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        #: url -> how many of its receives fail, and when: "before" the data (it never takes
        #: part: nobody gets the data) or "after" it (e.g. its answer is lost)
        self.fail_receives: dict[str, tuple[int, str]] = {}
        self.tp: dict[str, int] = {}

    def group(self, port: int) -> Group:
        return self.groups.setdefault(port, Group())

    def handler(self, url: str) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            path = request.url.path
            body = json.loads(request.content) if request.content else {}
            if path == "/version":
                return httpx.Response(200, json={"version": "0.26.0"})
            if path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "test"}]})
            if path == "/is_paused":
                return httpx.Response(200, json={"is_paused": True})
            if path == "/get_world_size":
                return httpx.Response(200, json={"world_size": self.tp.get(url, 1)})
            if path != "/collective_rpc":
                return httpx.Response(404)
            kw = {k: json.loads(v) for k, v in body["kwargs"].items()}
            self.requests.append((url, body["method"], kw))
            return self.rpc(url, body["method"], kw)

        return httpx.MockTransport(handle)

    def rpc(self, url: str, method: str, kw: dict[str, Any]) -> httpx.Response:
        tp = self.tp.get(url, 1)
        if method == "rolloutpool_layout":
            ranks = []
            for r in range(tp):
                got: dict[str, Any] = {"layout": {s.name: [s.dtype, list(s.shape)] for s in SPECS}}
                if tp > 1:
                    got.update(tp_rank=r, shards={SHARDED: [0, 4 * r, 4]})
                ranks.append(got)
            return httpx.Response(200, json={"results": ranks[::-1]})  # rank order not assumed
        if method == "rolloutpool_direct_init":
            port = int(kw["master_port"])
            self.members.setdefault(port, set()).add(url)
            self.group(port).add(self.group(port).joined, url)
            return httpx.Response(200, json={"results": [{"rank": kw["rank_offset"]}] * tp})
        if method == "rolloutpool_direct_receive":
            port = int(kw["group"].rsplit(":", 1)[1])
            g = self.group(port)
            fails, when = self.fail_receives.get(url, (0, ""))
            if fails and when == "before":
                self.fail_receives[url] = (fails - 1, when)
                return httpx.Response(500, json={"error": "layout refused"})
            g.add(g.receiving, url)
            if not g.sent.wait(kw.get("timeout_s", 5)):  # the worker's deadline: it aborts
                return httpx.Response(500, json={"error": "no data: group aborted"})
            if fails:
                self.fail_receives[url] = (fails - 1, when)
                return httpx.Response(500, json={"error": "answer lost"})
            results = []
            for r in range(tp):
                sums = {}
                for i, (name, dtype, shape) in enumerate(kw["names"]):
                    if tp > 1:
                        c = shard_sum(r) if name == SHARDED else SUMS[name]
                        sums[f"{name}@tp{r}"] = c.to_json()
                    else:
                        sums[name] = [dtype, shape, i, 2 * i]
                results.append({"received": len(kw["names"]), "checksums": sums, "tp_rank": r})
            return httpx.Response(200, json={"results": results})
        return httpx.Response(500, json={"error": f"unknown method {method}"})


class FabricSender(Sender):
    """The sender side: joins once every member of the group joined; 'broadcasts' once every
    member is receiving (never, if one never comes: until abandoned)."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.commands: list[Command[Any]] = []
        self.abandoned: list[str] = []
        self.expect: dict[str, set[str]] = {}  # group key -> member urls
        self.ports: dict[str, int] = {}

    def run(self, command: Command[Any]) -> Any:
        self.commands.append(command)
        match command:
            case DirectInit(at=at):
                self.ports[at.key] = at.port
                g = self.fabric.group(at.port)
                # every member joins before the sender returns (NCCL init is collective)
                with g.cond:
                    g.cond.wait_for(
                        lambda: (
                            sum(self.fabric.tp.get(u, 1) for u in g.joined) + 1 == at.world_size
                        ),
                        5,
                    )
                return 0.01
            case DirectSend(key=key, shards=shards):
                g = self.fabric.group(self.ports[key])
                members = self.fabric.members[self.ports[key]]
                if not g.wait_for(g.receiving, members, timeout=2):
                    raise RuntimeError("communicator aborted")
                g.sent.set()
                shard_sums = {shard_key(s): shard_sum(s[2] // 4).to_json() for s in shards}
                return {
                    "send_s": 0.01,
                    "checksum_s": 0.002,
                    "checksums": to_json(SUMS),
                    "shard_checksums": shard_sums,
                }
        return None

    def abandon(self, key: str) -> None:
        self.abandoned.append(key)

    def close(self) -> None:
        pass

    def inits(self) -> list[int]:
        return [c.at.world_size for c in self.commands if isinstance(c, DirectInit)]

    def sends(self) -> int:
        return sum(isinstance(c, DirectSend) for c in self.commands)


URLS = ["http://r1.test", "http://r2.test", "http://r3.test"]


def make(fabric: Fabric, **cfg: Any) -> tuple[NcclDirectTransport, list[VllmEngine], FabricSender]:
    sender = FabricSender(fabric)
    routes = {httpx.URL(u).host: fabric.handler(u) for u in URLS}

    class Router(httpx.AsyncBaseTransport, httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return routes[request.url.host].handle_request(request)

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await routes[request.url.host].handle_async_request(request)

    router = Router()
    transport = NcclDirectTransport(
        NcclConfig(master_port=31000, **cfg),
        SpecSource(),
        sender_impl=sender,
        http_transport=router,
        local_version="0.26.0",
    )
    engines = [VllmEngine(u, timeout=5.0, transport=router) for u in URLS]
    return transport, engines, sender


async def update(transport: NcclDirectTransport, engine: VllmEngine, delay: float = 0.0) -> Any:
    await transport.preflight(engine, target())
    await asyncio.sleep(delay)
    return await transport.transfer(engine, target())


def methods(fabric: Fabric, url: str) -> list[str]:
    return [m for u, m, _ in fabric.requests if u == url]


async def test_a_wave_is_one_group_and_one_broadcast_and_each_replica_checks_its_own() -> None:
    fabric = Fabric()
    fabric.tp[URLS[1]] = 2  # r2 is tensor-parallel: two workers, ranks 2 and 3
    transport, engines, sender = make(fabric)
    transport.expect_wave(URLS)
    evs = await asyncio.gather(*(update(transport, e, 0.05 * i) for i, e in enumerate(engines)))
    assert sender.inits() == [5] and sender.sends() == 1  # 1 + 1 + 2 + 1 ranks, one send
    inits = [(u, kw["rank_offset"]) for u, m, kw in fabric.requests if m.endswith("_init")]
    assert sorted(inits) == [(URLS[0], 1), (URLS[1], 2), (URLS[2], 4)]
    [send] = [c for c in sender.commands if isinstance(c, DirectSend)]
    assert send.shards == ((SHARDED, 0, 0, 4), (SHARDED, 0, 4, 4))
    for url, ev in zip(URLS, evs, strict=True):
        assert (
            ev.ok and ChecksumEvidence.compare(ev.checksums, ev.replica_checksums).proves_equal
        ), url
        [receive] = [kw for u, m, kw in fabric.requests if u == url and m.endswith("receive")]
        assert receive["timeout_s"] == 60.0
        assert transport.last[url]["wave_size"] == 3
    tp_sums = evs[1].checksums
    assert tp_sums[f"{SHARDED}@tp1"] == shard_sum(1) and len(tp_sums) == 2 * len(SPECS)
    assert evs[0].checksums == SUMS  # a TP=1 member: by name, as alone
    fabric.groups.clear()
    transport.expect_wave(URLS)
    await asyncio.gather(*(update(transport, e) for e in engines))
    assert sender.inits() == [5] and sender.sends() == 2  # the group is reused
    for e in engines:
        await e.aclose()


async def test_without_a_wave_each_replica_has_its_own_group() -> None:
    fabric = Fabric()
    transport, engines, sender = make(fabric)
    await update(transport, engines[0])
    assert sender.inits() == [2] and sender.sends() == 1
    assert [m for m in methods(fabric, URLS[0]) if "receive" in m] == ["rolloutpool_direct_receive"]
    [receive] = [kw for _, m, kw in fabric.requests if m.endswith("receive")]
    assert "timeout_s" not in receive  # the k = 1 path is unchanged
    for e in engines:
        await e.aclose()


async def test_a_replica_that_does_not_arrive_in_time_is_sent_alone() -> None:
    fabric = Fabric()
    transport, engines, sender = make(fabric, wave_gather_s=0.3)
    transport.expect_wave(URLS)
    late = asyncio.create_task(update(transport, engines[2], delay=1.0))
    await asyncio.gather(update(transport, engines[0]), update(transport, engines[1]))
    assert sender.inits() == [3] and sender.sends() == 1  # the two that came, together
    ev = await late
    assert sender.inits() == [3, 2] and sender.sends() == 2  # the late one, over its own group
    assert ev.ok and ChecksumEvidence.compare(ev.checksums, ev.replica_checksums).proves_equal
    for e in engines:
        await e.aclose()


async def test_a_refused_replica_leaves_the_wave_at_once() -> None:
    fabric = Fabric()
    transport, engines, sender = make(fabric, wave_gather_s=30.0)  # no waiting on a timer
    transport.expect_wave(URLS)

    async def refused() -> None:
        with pytest.raises(PreflightFailed):
            await transport.preflight(engines[2], target(digest="0" * 64))

    await asyncio.wait_for(
        asyncio.gather(update(transport, engines[0]), update(transport, engines[1]), refused()),
        timeout=10,
    )
    assert sender.inits() == [3] and sender.sends() == 1
    for e in engines:
        await e.aclose()


async def test_a_member_that_fails_after_its_data_is_resent_alone_the_other_completes() -> None:
    fabric = Fabric()
    fabric.fail_receives[URLS[1]] = (1, "after")
    transport, engines, sender = make(fabric)
    transport.expect_wave(URLS[:2])
    ev1, ev2 = await asyncio.gather(update(transport, engines[0]), update(transport, engines[1]))
    assert ChecksumEvidence.compare(ev1.checksums, ev1.replica_checksums).proves_equal
    assert "alone" not in transport.last[URLS[0]] and transport.last[URLS[0]]["wave_size"] == 2
    assert "its receive failed" in transport.last[URLS[1]]["alone"]
    assert ChecksumEvidence.compare(
        ev2.checksums, ev2.replica_checksums
    ).proves_equal  # re-sent, complete
    assert sender.inits() == [3, 2] and sender.sends() == 2  # the wave, then r2 alone
    assert sender.abandoned[0].startswith("wave:")  # the failed wave's group is dropped
    for e in engines:
        await e.aclose()


async def test_a_member_that_never_takes_part_gets_every_member_resent_alone() -> None:
    fabric = Fabric()
    fabric.fail_receives[URLS[1]] = (1, "before")  # nobody gets the data
    transport, engines, sender = make(fabric, wave_receive_timeout_s=0.5)
    transport.expect_wave(URLS[:2])
    evs = await asyncio.gather(update(transport, engines[0]), update(transport, engines[1]))
    for url, ev in zip(URLS, evs, strict=False):
        assert "alone" in transport.last[url], url
        assert ChecksumEvidence.compare(ev.checksums, ev.replica_checksums).proves_equal, url
    assert sender.inits() == [3, 2, 2] and sender.sends() == 3
    for e in engines:
        await e.aclose()


async def test_a_member_cancelled_while_gathering_leaves_the_wave() -> None:
    fabric = Fabric()
    transport, engines, sender = make(fabric, wave_gather_s=30.0)
    transport.expect_wave(URLS)
    gone = asyncio.create_task(update(transport, engines[2]))
    await asyncio.sleep(0.2)
    gone.cancel()
    await asyncio.wait_for(
        asyncio.gather(update(transport, engines[0]), update(transport, engines[1])), timeout=10
    )
    assert sender.inits() == [3] and sender.sends() == 1
    for e in engines:
        await e.aclose()
