"""``updater.transports.nccl.senders``: the typed calls, the sending child's dispatch and its
lifecycle. No GPU: the commands sent here never reach torch or vLLM (a test command that builds
a source and returns its specs; a core whose vLLM calls are replaced by recorders)."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pool.types import TensorSpec
from updater.transports.nccl import (
    HttpWeightSyncClient,
    Packing,
    ProcessSender,
    SenderCore,
    SourceSpec,
    ThreadSender,
    WeightSource,
)
from updater.transports.nccl.senders import Command, Rendezvous, WireSource, _child_main


class Empty(WeightSource):
    """A source without tensors, built in the child from ``SourceSpec(f"{__name__}:Empty")``."""

    def specs(self) -> list[TensorSpec]:
        return []

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(())


@dataclass(frozen=True)
class Specs(Command[list[TensorSpec]]):
    """Builds ``spec``'s source in the core and answers its specs (needs no torch)."""

    spec: SourceSpec

    def run(self, core: SenderCore) -> list[TensorSpec]:
        return core.source(self.spec).specs()


class RecordingCore(SenderCore):
    """A core whose vLLM calls only record their arguments (the dispatch is under test)."""

    def __init__(self) -> None:
        super().__init__("cuda:0")
        self.seen: list[tuple[str, tuple[Any, ...]]] = []

    def prepare(self, source: WireSource) -> None:
        self.seen.append(("prepare", (source,)))

    def static_init(self, at: Rendezvous) -> float:
        self.seen.append(("static_init", (at,)))
        return 1.5

    def static_send(
        self, key: str, source: WireSource, packing: Packing, chunk_timings: bool
    ) -> dict[str, Any]:
        self.seen.append(("static_send", (key, source, packing, chunk_timings)))
        return {"send_s": 2.0}

    def factory_init(self, at: Rendezvous, packing: Packing, client: HttpWeightSyncClient) -> float:
        self.seen.append(("factory_init", (at, packing, client)))
        return 3.5

    def factory_send(self, key: str, source: WireSource) -> dict[str, Any]:
        self.seen.append(("factory_send", (key, source)))
        return {"send_s": 4.0}


def test_each_typed_call_reaches_its_core_method_with_its_arguments() -> None:
    core = RecordingCore()
    sender = ThreadSender("cuda:0", core)
    at, src, packing = Rendezvous("u#0", "10.0.0.1", 30000, 3), Empty(), Packing(num_buffers=4)
    client = HttpWeightSyncClient("http://u")
    sender.prepare(src)
    assert sender.static_init(at) == 1.5
    assert sender.static_send("u#0", src, packing, True) == {"send_s": 2.0}
    assert sender.factory_init(at, packing, client) == 3.5
    assert sender.factory_send("u#0", src) == {"send_s": 4.0}
    assert core.seen == [
        ("prepare", (src,)),
        ("static_init", (at,)),
        ("static_send", ("u#0", src, packing, True)),
        ("factory_init", (at, packing, client)),
        ("factory_send", ("u#0", src)),
    ]


def test_the_child_runs_commands_and_answers_anything_else_with_an_error() -> None:
    parent, child = multiprocessing.Pipe()
    loop = threading.Thread(target=_child_main, args=(child, "cuda:0"), daemon=True)
    loop.start()  # the child's loop, here in a thread: the dispatch is what is under test
    parent.send(Specs(SourceSpec(f"{__name__}:Empty")))
    assert parent.recv() == ("ok", [])
    parent.send(("static_init", ("k", "127.0.0.1", 30000, 2)))  # a method name is no command
    assert parent.recv() == ("err", "TypeError: not a sender command: tuple")
    parent.send_bytes(b"not a pickle")
    status, _ = parent.recv()
    assert status == "err"
    parent.send(Specs(SourceSpec("no_such_module_here:X")))
    assert parent.recv() == ("err", "ModuleNotFoundError: No module named 'no_such_module_here'")
    parent.close()
    loop.join(5)
    assert not loop.is_alive()  # the parent's end closed: the loop ends


def test_process_sender_reports_errors_and_restarts_after_kill() -> None:
    sender = ProcessSender("cuda:0")
    try:
        spec = SourceSpec(f"{__name__}:Empty")
        assert sender.run(Specs(spec)) == []  # built in the child, answered from there
        pid, epoch = sender.pid, sender.epoch
        assert pid is not None and epoch == 1
        with pytest.raises(RuntimeError, match="sender process: Specs: ModuleNotFoundError"):
            sender.run(Specs(SourceSpec("no_such_module_here:X")))
        assert sender.pid == pid  # an error in a command leaves the child running
        sender.abandon("any")  # kills the child with every group it held
        assert sender.run(Specs(spec)) == []
        assert sender.pid != pid and sender.epoch == epoch + 1
    finally:
        sender.close()
