"""Checksum validation on a real vLLM CPU replica running RolloutPool's worker extension.

The replica is started with ``--worker-extension-cls pool.replica_extension.WeightExtension``
(vLLM's supported plug-in point, through ``ReplicaSpec.extra_args``); the updater is the sender
(``ReloadTransport(checksums=True)``: it checksums the checkpoint in preflight; after the reload
the replica checksums its runtime weights, oneDNN-repacked linears recovered through the
identity). Negative controls, both invisible to the greedy probe (the marker model's attention
and MLP branches are dead: ``o_proj`` and ``down_proj`` are zero, so q/k/v/gate/up weights never
reach the output) and both refused by validation, TAINTED, never published:

* one flipped bit in one tensor of the checkpoint the replica loads (changed after the check);
* a transfer cut after 90 % of the tensors: the last 10 % (in file order) still hold the
  replica's previous weights.

Without checksums the flipped checkpoint *is* published (the control that shows the probe alone
cannot tell). Uses core 1 and the heavy lock like the other integration tests.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

from pool.checkpoint import checkpoint_checksums
from pool.checksum import from_json
from pool.engine import VllmEngine
from pool.evidence import TransferEvidence
from pool.types import ReplicaState
from testkit.redis_server import RedisServer
from tests.integration.marker_pool import Pool, marker_dir, marker_pool, target
from updater.cycle import CycleError, CycleRunner, Deadlines
from updater.transports.base import WeightsTarget
from updater.transports.reload import ReloadTransport

pytestmark = pytest.mark.integration
S = ReplicaState
EXTENSION = ("--worker-extension-cls", "pool.replica_extension.WeightExtension")
DEAD = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "layernorm")


def variant(g: int, directory: Path, seed: int) -> Path:
    """Marker ``g`` with every weight of the dead branches re-drawn from ``seed``: the probe
    (marker token of ``g``) is unchanged, almost every tensor differs from marker ``g``'s."""
    tensors = load_file(str(marker_dir(g) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if any(part in name for part in DEAD):
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype)
    shutil.copytree(marker_dir(g), directory, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


class CorruptingReload(ReloadTransport):
    """Fault injection: after the real preflight (which checksummed the checkpoint), ``corrupt``
    rewrites the checkpoint before the replica reloads it, as storage or a partial copy would."""

    def __init__(self, corrupt: Callable[[Path], None]) -> None:
        super().__init__(checksums=True)
        self.corrupt = corrupt

    async def transfer(self, engine: VllmEngine, target: WeightsTarget) -> TransferEvidence:
        self.corrupt(target.path)
        return await super().transfer(engine, target)


def flip_one_bit(path: Path) -> None:
    """Flip the lowest bit of one word of one dead-branch tensor (the probe cannot see it)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.self_attn.k_proj.weight"
    words = tensors[name].view(torch.int32).view(-1)
    words[17] ^= 1
    save_file(tensors, str(file), metadata={"format": "pt"})


def cut_after_90_percent(previous: Path) -> Callable[[Path], None]:
    """The last 10 % of the tensors (file order) keep the replica's current weights."""

    def cut(path: Path) -> None:
        file = path / "model.safetensors"
        new, old = load_file(str(file)), load_file(str(previous / "model.safetensors"))
        order = sorted(new)  # safetensors writes one dtype's tensors sorted by name
        for name in order[math.floor(len(order) * 0.9) :]:
            new[name] = old[name]
        save_file(new, str(file), metadata={"format": "pt"})

    return cut


@pytest_asyncio.fixture(scope="module")
async def pool(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Pool]:
    work = tmp_path_factory.mktemp("checksum")
    transport = ReloadTransport(checksums=True)
    async with marker_pool(
        redis_server.url,
        work,
        "checksum",
        transport,
        extra_args=EXTENSION,
        bootstrap_checkpoint=True,
    ) as p:
        yield p


async def latest(p: Pool) -> int:
    gen, _ = await p.store.latest()  # type: ignore[misc]
    return int(gen.number)


async def test_checksums_prove_the_update_and_refuse_corruption(pool: Pool, tmp_path: Path) -> None:
    p = pool
    # the replica's checksums (runtime weights, repacked linears recovered) = the checkpoint's
    rpc = await p.handle.engine.collective_rpc("rolloutpool_checksums")
    assert from_json(rpc.results[0]["checksums"]) == checkpoint_checksums(marker_dir(0))

    good = target(1, variant(1, tmp_path / "g1", seed=11))
    report = await p.runner.run(p.handle, good)
    assert report.outcome == "ready" and "checksum" in report.phases
    assert await latest(p) == 1
    sums = p.runner.transport._sums  # type: ignore[attr-defined]  # what preflight computed
    print(
        f"checksum_s on CPU: sender (updater over the checkpoint, preflight) {sums.seconds:.4f}s; "
        f"replica call + compare {report.phases['checksum']:.4f}s of window {report.window_s:.3f}s"
    )

    # control: without checksums, one flipped bit passes the probe and is published
    flipped_ok = variant(2, tmp_path / "g2", seed=12)
    flip_one_bit(flipped_ok)
    blind = CycleRunner(p.store, p.lease, ReloadTransport(), deadlines=Deadlines(transfer_s=30))
    assert (await blind.run(p.handle, target(2, flipped_ok))).outcome == "ready"
    assert await latest(p) == 2

    # one flipped bit after the check: refused by validation, TAINTED, never published
    flip = CycleRunner(p.store, p.lease, CorruptingReload(flip_one_bit))
    with pytest.raises(CycleError) as e:
        await flip.run(p.handle, target(3, variant(3, tmp_path / "g3", seed=13)))
    assert e.value.report.outcome == "tainted" and "checksums" in e.value.report.reason
    assert "mismatched=1" in e.value.report.reason and "k_proj" in e.value.report.reason
    assert (await p.store.replica("r0")).state is S.TAINTED and await latest(p) == 2

    # recovery (I6), the latest generation loaded and its checksums proven again
    await p.runner.start_recovery(p.handle, "after the flipped bit")
    await p.replica.restart()
    back = target(2, flipped_ok)
    boot = await p.runner.bootstrap(p.handle, back.generation, back.identity, back.probe, back.path)
    assert boot.outcome == "ready" and "checksum" in boot.phases

    # a transfer cut after 90 % of the tensors: refused, TAINTED, never published
    cut = CycleRunner(p.store, p.lease, CorruptingReload(cut_after_90_percent(flipped_ok)))
    with pytest.raises(CycleError) as e:
        await cut.run(p.handle, target(4, variant(4, tmp_path / "g4", seed=14)))
    assert e.value.report.outcome == "tainted" and "checksums" in e.value.report.reason
    assert (await p.store.replica("r0")).state is S.TAINTED and await latest(p) == 2
