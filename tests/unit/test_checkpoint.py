"""Manifest reading from safetensors headers (no torch): dtypes, shards, malformed files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pool.checkpoint import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    content_hash,
    read_header,
    read_manifest,
)
from pool.errors import PreflightFailed


def write_raw(path: Path, header: dict[str, object], payload: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)


def test_numpy_file_manifest(tmp_path: Path) -> None:
    save_file(
        {
            "b.weight": np.zeros((4, 3), dtype=np.float32),
            "a.bias": np.zeros((3,), dtype=np.float16),
            "c.ids": np.zeros((2, 2, 2), dtype=np.int64),
        },
        str(tmp_path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    m = read_manifest(tmp_path)
    assert [(t.name, t.shape, t.dtype) for t in m.tensors] == [
        ("a.bias", (3,), "float16"),
        ("b.weight", (4, 3), "float32"),
        ("c.ids", (2, 2, 2), "int64"),
    ]
    assert "__metadata__" in read_header(tmp_path / "model.safetensors")


def test_dtype_mapping_by_hand_including_bf16(tmp_path: Path) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for i, tag in enumerate(sorted(SAFETENSORS_DTYPES)):
        header[f"t{i:02d}"] = {"dtype": tag, "shape": [1], "data_offsets": [offset, offset + 8]}
        offset += 8
    write_raw(tmp_path / "x.safetensors", header, b"\0" * offset)
    m = read_manifest(tmp_path)
    got = {t.name: t.dtype for t in m.tensors}
    assert got == {
        f"t{i:02d}": SAFETENSORS_DTYPES[tag] for i, tag in enumerate(sorted(SAFETENSORS_DTYPES))
    }
    assert SAFETENSORS_DTYPES["BF16"] == "bfloat16" and SAFETENSORS_DTYPES["F32"] == "float32"


def test_dtype_change_changes_digest_and_diff_names_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_raw(
        a / "m.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    )
    write_raw(
        b / "m.safetensors", {"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}
    )
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.digest != mb.digest
    assert ma.diff(mb) == ["w: dtype bfloat16 != expected float32"]


def test_sharded_directory_without_and_with_index(tmp_path: Path) -> None:
    save_file(
        {"layer.0.w": np.zeros((2, 2), np.float32)},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"layer.1.w": np.zeros((2, 3), np.float32)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    unindexed = read_manifest(tmp_path)
    assert [t.name for t in unindexed.tensors] == ["layer.0.w", "layer.1.w"]
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {
                    "layer.0.w": "model-00001-of-00002.safetensors",
                    "layer.1.w": "model-00002-of-00002.safetensors",
                },
            }
        )
    )
    save_file({"junk": np.zeros((1,), np.float32)}, str(tmp_path / "consolidated.safetensors"))
    indexed = read_manifest(tmp_path)  # the index decides: the stray file is not read
    assert indexed == unindexed


def test_index_naming_a_missing_shard_is_refused(tmp_path: Path) -> None:
    save_file({"w": np.zeros((1,), np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "w": "model-00001-of-00002.safetensors",
                    "v": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    with pytest.raises(CheckpointError, match="missing shards"):
        read_manifest(tmp_path)


def test_duplicate_tensor_across_shards_is_refused(tmp_path: Path) -> None:
    save_file({"w": np.zeros((1,), np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.zeros((1,), np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match="more than one shard"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x01\x00",
        struct.pack("<Q", 1 << 40) + b"{}",
        struct.pack("<Q", 50) + b"{}",
        struct.pack("<Q", 5) + b"nope!",
        struct.pack("<Q", 2) + b"[]",
    ],
    ids=["empty", "short", "huge-length", "truncated", "not-json", "not-object"],
)
def test_malformed_headers_are_checkpoint_errors(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError):
        read_manifest(tmp_path)


def test_unknown_dtype_and_missing_dir_are_preflight_failures(tmp_path: Path) -> None:
    write_raw(
        tmp_path / "m.safetensors", {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}
    )
    with pytest.raises(CheckpointError, match="unknown dtype"):
        read_manifest(tmp_path)
    with pytest.raises(PreflightFailed, match="does not exist"):
        read_manifest(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PreflightFailed, match=r"no \*\.safetensors"):
        read_manifest(empty)


def test_content_hash_streams_and_tracks_bytes(tmp_path: Path) -> None:
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    h1 = content_hash(tmp_path, chunk_bytes=64)
    assert h1 == content_hash(tmp_path) and h1.startswith("sha256:")
    save_file({"w": np.arange(1000, dtype=np.float32) + 1}, str(tmp_path / "model.safetensors"))
    assert content_hash(tmp_path) != h1


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/tmp/outside.safetensors", "sub/inner.safetensors", ".."],
    ids=["parent", "absolute", "subdir", "dotdot"],
)
def test_index_may_name_only_plain_files_inside_the_directory(tmp_path: Path, shard: str) -> None:
    """Preflight followed ``../`` and absolute shard names out of the
    checkpoint directory. The index may only name plain files in it."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    save_file({"w": np.zeros((1,), np.float32)}, str(tmp_path / "outside.safetensors"))
    save_file({"w": np.zeros((1,), np.float32)}, str(ckpt / "sub" / "inner.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="not plain file names"):
        read_manifest(ckpt)


def test_symlinks_out_of_the_directory_and_non_files_are_refused(tmp_path: Path) -> None:
    """A symlinked shard pointing outside the checkpoint was read, and
    the 422 echoed 8 bytes of its target (as the "header length"). Now it is refused unopened."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"TOPSECRET-password-1234")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(secret)
    with pytest.raises(CheckpointError, match="not a regular file inside") as e:
        read_manifest(ckpt)
    assert "TOPSECRET" not in str(e.value) and str(
        int.from_bytes(b"TOPSECRE", "little")
    ) not in str(e.value)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()  # a directory named like a shard
    with pytest.raises(CheckpointError, match="not a regular file inside"):
        read_manifest(ckpt)
    (ckpt / "model.safetensors").rmdir()
    save_file({"w": np.zeros((1,), np.float32)}, str(ckpt / "real.safetensors"))
    (ckpt / "model.safetensors").symlink_to(ckpt / "real.safetensors")  # inside: allowed
    with pytest.raises(CheckpointError, match="more than one shard"):  # read, then a duplicate
        read_manifest(ckpt)


def test_a_non_safetensors_file_is_refused_without_quoting_its_bytes(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"SECRETS!" + b"x" * 100)
    with pytest.raises(CheckpointError) as e:
        read_manifest(tmp_path)
    assert str(int.from_bytes(b"SECRETS!", "little")) not in str(e.value)


def test_a_hard_linked_shard_is_refused(tmp_path: Path) -> None:
    """Audit finding: confinement resolved symlinks but not hard links, which have no "inside"
    (a hard link to any file of the filesystem passed)."""
    outside = tmp_path / "outside.safetensors"
    save_file({"w": np.zeros((1,), np.float32)}, str(outside))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.link(outside, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="hard links"):
        read_manifest(ckpt)


def test_a_truncated_header_does_not_echo_its_declared_length(tmp_path: Path) -> None:
    """Audit finding: "header truncated (2 of N bytes)" quoted N, eight bytes of the file."""
    declared = int.from_bytes(b"SECRETS!", "little") % (1 << 20) + 100
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", declared) + b"{}")
    with pytest.raises(CheckpointError, match="truncated") as e:
        read_manifest(tmp_path)
    assert str(declared) not in str(e.value)
