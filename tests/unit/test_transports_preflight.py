"""``updater.transports.preflight``: the one target check of every transport, each refusal once,
on real safetensors checkpoints (written with numpy, no torch); and the reload transport's
preflight, which is that check and never contacts the engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.checkpoint import CheckpointError, content_hash, read_manifest
from pool.engine import VllmEngine
from pool.errors import PreflightFailed
from pool.types import Manifest, TensorSpec, WeightIdentity
from updater.transports.base import WeightsTarget
from updater.transports.preflight import (
    check_checkpoint,
    check_location,
    check_provenance,
    check_weights,
)
from updater.transports.reload import ReloadTransport


def checkpoint(directory: Path, mlp: int = 4, dtype: type = np.float32) -> Path:
    directory.mkdir()
    save_file(
        {"mlp.weight": np.zeros((mlp, 2), dtype), "norm.weight": np.ones(2, np.float32)},
        str(directory / "model.safetensors"),
    )
    return directory


@pytest.fixture
def target(tmp_path: Path) -> WeightsTarget:
    """A checkpoint and the target that names it exactly (content hash declared)."""
    path = checkpoint(tmp_path / "ckpt")
    manifest = read_manifest(path)
    identity = WeightIdentity(
        manifest_digest=manifest.digest, checkpoint_uri=str(path), content_hash=content_hash(path)
    )
    return WeightsTarget(identity=identity, path=path, expected_manifest=manifest)


async def test_a_matching_checkpoint_passes_every_check(target: WeightsTarget) -> None:
    assert await check_checkpoint(target, verify_content_hash=True) == target.expected_manifest
    file_uri = replace(
        target, identity=target.identity.model_copy(update={"checkpoint_uri": target.path.as_uri()})
    )
    await check_provenance(file_uri, verify_content_hash=True)  # a file:// URI names it too


def test_location_refuses_a_relative_path_a_missing_one_and_a_file(
    target: WeightsTarget, tmp_path: Path
) -> None:
    for path, words in [
        (Path("relative/ckpt"), "must be absolute"),
        (tmp_path / "gone", "does not exist"),
        (target.path / "model.safetensors", "does not exist"),
    ]:
        with pytest.raises(PreflightFailed, match=words) as err:
            check_location(replace(target, path=path))
        assert err.value.context["path"] == str(path)
    check_location(target)


@pytest.mark.parametrize(
    ("mlp", "dtype", "words"),
    [
        (8, np.float32, "mlp.weight: shape [8, 2] != expected [4, 2]"),
        (4, np.float16, "mlp.weight: dtype float16 != expected float32"),
    ],
    ids=["shape", "dtype"],
)
def test_weights_refuse_another_layout_with_the_readable_diff(
    target: WeightsTarget, tmp_path: Path, mlp: int, dtype: type, words: str
) -> None:
    other = read_manifest(checkpoint(tmp_path / "other", mlp, dtype))
    with pytest.raises(PreflightFailed, match="manifest does not match") as err:
        check_weights(target, other)
    assert err.value.context["diff"] == [words]
    assert err.value.context["expected_digest"] == target.expected_manifest.digest
    assert err.value.context["actual_digest"] == other.digest


def test_weights_name_missing_and_unexpected_tensors(target: WeightsTarget) -> None:
    renamed = Manifest.of(
        [*target.expected_manifest.tensors[:1], TensorSpec(name="extra", shape=(2,), dtype="bool")]
    )
    with pytest.raises(PreflightFailed) as err:
        check_weights(target, renamed, what="source")
    assert err.value.context["diff"] == ["missing tensor norm.weight", "unexpected tensor extra"]
    assert str(err.value).startswith("source manifest does not match")
    assert "path" not in err.value.context  # an in-process source has no path


def test_weights_refuse_an_identity_that_declares_another_manifest(
    target: WeightsTarget,
) -> None:
    wrong = target.identity.model_copy(update={"manifest_digest": "sha256:" + "0" * 64})
    with pytest.raises(PreflightFailed, match="identity mismatch: declared manifest digest"):
        check_weights(replace(target, identity=wrong), target.expected_manifest)


async def test_provenance_refuses_another_uri(target: WeightsTarget) -> None:
    wrong = target.identity.model_copy(update={"checkpoint_uri": "/elsewhere"})
    with pytest.raises(PreflightFailed, match="declared checkpoint_uri '/elsewhere'"):
        await check_provenance(replace(target, identity=wrong), verify_content_hash=False)


async def test_provenance_refuses_another_content_hash_only_when_verifying(
    target: WeightsTarget,
) -> None:
    wrong = replace(
        target, identity=target.identity.model_copy(update={"content_hash": "sha256:" + "1" * 64})
    )
    with pytest.raises(PreflightFailed, match="declared content hash"):
        await check_provenance(wrong, verify_content_hash=True)
    await check_provenance(wrong, verify_content_hash=False)  # not read: accepted


async def test_check_checkpoint_refuses_a_directory_that_is_not_a_checkpoint(
    target: WeightsTarget, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        await check_checkpoint(replace(target, path=empty), verify_content_hash=False)


async def test_reload_preflight_is_the_shared_check_and_never_contacts_the_engine(
    target: WeightsTarget, tmp_path: Path
) -> None:
    requests: list[str] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        requests.append(request.url.path)
        return httpx.Response(500)

    engine = VllmEngine("http://replica.test", timeout=1.0, transport=httpx.MockTransport(refuse))
    transport = ReloadTransport()
    await transport.preflight(engine, target)
    wrong = replace(target, expected_manifest=read_manifest(checkpoint(tmp_path / "wide", 8)))
    with pytest.raises(PreflightFailed, match="shape"):
        await transport.preflight(engine, wrong)
    bad_hash = target.identity.model_copy(update={"content_hash": "sha256:" + "1" * 64})
    with pytest.raises(PreflightFailed, match="content hash"):
        await transport.preflight(engine, replace(target, identity=bad_hash))
    await ReloadTransport(verify_content_hash=False).preflight(
        engine, replace(target, identity=bad_hash)
    )
    assert requests == []
    await engine.aclose()
