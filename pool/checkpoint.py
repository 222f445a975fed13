"""Read a safetensors checkpoint directory's parameter manifest without torch.

A safetensors file starts with an 8-byte little-endian unsigned length ``N``, followed by ``N``
bytes of JSON: ``{"<tensor name>": {"dtype": "F32", "shape": [..], "data_offsets": [a, b]},
..., "__metadata__": {...}}``. Only that header is read, so a manifest of a multi-gigabyte
checkpoint costs a few kilobytes of I/O.

Sharded checkpoints (``model-00001-of-00002.safetensors`` + ``model.safetensors.index.json``)
are supported: when an index file exists, exactly the shards it names are read; otherwise every
``*.safetensors`` file in the directory is. A tensor that appears in two shards is an error.

Everything here raises :class:`CheckpointError` (a :class:`~pool.errors.PreflightFailed`) for an
unreadable or malformed checkpoint: refusing a checkpoint never mutates anything.

**Confinement.** A checkpoint is the files *inside* its directory: an index may name shards only by
plain file names (no ``/``, no ``..``, not absolute), and every shard must resolve, symlinks
followed, to a regular file inside the directory. Anything else is refused before it is opened,
and error messages never quote bytes read from a file. (A Hugging Face cache *snapshot* links its
files to blobs outside the snapshot directory: push a directory of real files instead, e.g.
``snapshot_download(..., local_dir=...)`` or the trainer's ``save_pretrained`` output.)
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pool.checksum import Checksum, words_checksum
from pool.errors import PreflightFailed
from pool.types import Manifest, TensorSpec

__all__ = [
    "ONE_BYTE_DTYPES",
    "SAFETENSORS_DTYPES",
    "CheckpointError",
    "checkpoint_checksums",
    "content_hash",
    "read_header",
    "read_manifest",
    "safetensors_files",
    "tensor_bytes",
    "vocab_size",
]

#: safetensors dtype tag -> torch attribute name (``getattr(torch, name)``).
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}

#: Headers larger than this are refused (the format's own readers use 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(PreflightFailed):
    """The checkpoint directory is missing, unreadable or not valid safetensors. Its API code is
    ``preflight_failed`` like every refusal before mutation (the message says what is wrong)."""


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files that make up the checkpoint in ``directory``, sorted by name.

    With ``model.safetensors.index.json`` present, the shards named in its ``weight_map``
    (each must exist); otherwise every ``*.safetensors`` file. Raises :class:`CheckpointError`
    if the directory does not exist or holds no safetensors file.
    """
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint directory does not exist: {directory}", path=str(directory)
        )
    index = directory / INDEX_FILE
    if index.is_file():
        _confined(directory, index)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"unreadable index {index}: {e}", path=str(directory)) from e
        bad = [
            n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")
        ]
        if bad:
            raise CheckpointError(
                f"index {INDEX_FILE} names shards that are not plain file names in the "
                f"checkpoint directory: {bad[:5]!r}",
                path=str(directory),
            )
        files = [directory / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"index {INDEX_FILE} names missing shards: {missing}", path=str(directory)
            )
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {directory}", path=str(directory))
    for file in files:
        _confined(directory, file)
    return files


def _confined(directory: Path, file: Path) -> None:
    """Refuse ``file`` unless it resolves to a regular file inside ``directory`` that has no
    other name: a hard link has no "inside", it may be any file of the filesystem."""
    try:
        target = file.resolve(strict=True)
        inside = target.is_relative_to(directory.resolve(strict=True))
        links = target.stat().st_nlink
    except (OSError, RuntimeError):  # dangling link, loop
        inside, links = False, 1
        target = file
    if not inside or not target.is_file():
        raise CheckpointError(
            f"{file.name} is not a regular file inside the checkpoint directory {directory} "
            "(symlinks must stay inside it)",
            path=str(directory),
        )
    if links > 1:
        raise CheckpointError(
            f"{file.name} in the checkpoint directory {directory} has {links} hard links: "
            "a checkpoint's files must have one name each (copy the file instead of linking)",
            path=str(directory),
        )


def read_header(file: Path) -> dict[str, Any]:
    """The parsed JSON header of one safetensors file (``__metadata__`` included).

    Reads ``8 + N`` bytes. Raises :class:`CheckpointError` on a short file, an absurd header
    length, or a header that is not a JSON object.
    """
    try:
        with file.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{file}: too short for a safetensors header", path=str(file))
            (n,) = struct.unpack("<Q", raw_len)
            if n <= 1 or n > MAX_HEADER_BYTES:  # the value is not echoed: it is file content
                raise CheckpointError(
                    f"{file}: not a safetensors file (implausible header length)", path=str(file)
                )
            blob = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}", path=str(file)) from e
    if len(blob) != n:
        raise CheckpointError(  # the declared length is file content: not echoed
            f"{file}: header truncated (the file ends after {len(blob)} header bytes)",
            path=str(file),
        )
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file}: header is not JSON", path=str(file)) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: header is not a JSON object", path=str(file))
    return header


def _spec(file: Path, name: str, entry: Any) -> TensorSpec:
    if not isinstance(entry, dict) or "dtype" not in entry or "shape" not in entry:
        raise CheckpointError(f"{file}: malformed entry for tensor {name!r}", path=str(file))
    tag = entry["dtype"]
    dtype = SAFETENSORS_DTYPES.get(tag)
    if dtype is None:
        raise CheckpointError(f"{file}: tensor {name!r} has unknown dtype {tag!r}", path=str(file))
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{file}: tensor {name!r} has bad shape {shape!r}", path=str(file))
    return TensorSpec(name=name, shape=tuple(shape), dtype=dtype)


def read_manifest(directory: Path) -> Manifest:
    """The :class:`~pool.types.Manifest` (names, shapes, torch dtype names) of a checkpoint.

    Reads only headers. Raises :class:`CheckpointError` for a missing directory, no safetensors
    files, a malformed header, an unknown dtype, or a tensor name present in two shards.
    """
    specs: dict[str, TensorSpec] = {}
    for file in safetensors_files(directory):
        for name, entry in read_header(file).items():
            if name == "__metadata__":
                continue
            if name in specs:
                raise CheckpointError(
                    f"tensor {name!r} appears in more than one shard (again in {file.name})",
                    path=str(directory),
                )
            specs[name] = _spec(file, name, entry)
    return Manifest.of(specs.values())


def content_hash(directory: Path, chunk_bytes: int = 1 << 20) -> str:
    """``sha256:<hex>`` over the checkpoint's safetensors files (names and bytes), streamed.

    Files are taken in :func:`safetensors_files` order; each contributes its name, its length
    and its bytes, so renaming or re-sharding changes the hash. Cost: one full read of the
    weights. Raises :class:`CheckpointError` if the directory is not a checkpoint.
    """
    h = hashlib.sha256()
    for file in safetensors_files(directory):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def vocab_size(directory: Path) -> int | None:
    """The model's vocabulary size: ``vocab_size`` of ``config.json`` (Hugging Face layout),
    else the rows of the input embedding (a 2-D tensor whose name ends in ``embed_tokens.weight``);
    None if neither says."""
    try:
        value = json.loads((directory / "config.json").read_text()).get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    except (OSError, ValueError, AttributeError):
        pass
    for spec in read_manifest(directory).tensors:
        if spec.name.endswith("embed_tokens.weight") and len(spec.shape) == 2:
            return spec.shape[0]
    return None


def tensor_bytes(directory: Path) -> Iterator[tuple[TensorSpec, memoryview]]:
    """Every tensor of the checkpoint with its stored bytes (each file memory-mapped; no torch).
    A view is valid only until the next item: copy what must outlive it. Raises
    :class:`CheckpointError` like :func:`read_manifest`, and for a tensor whose byte range lies
    outside its file."""
    for file in safetensors_files(directory):
        header = read_header(file)
        try:
            with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                base = 8 + struct.unpack("<Q", mm[:8])[0]
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    spec = _spec(file, name, entry)
                    begin, end = (base + int(o) for o in entry.get("data_offsets", (0, 0)))
                    if not base <= begin <= end <= len(mm):
                        raise CheckpointError(
                            f"{file}: tensor {name!r} lies outside the file", path=str(file)
                        )
                    with memoryview(mm)[begin:end] as data:
                        yield spec, data
        except (OSError, ValueError, BufferError) as e:
            raise CheckpointError(f"{file}: cannot read: {e}", path=str(file)) from e


def checkpoint_checksums(directory: Path) -> dict[str, Checksum]:
    """:mod:`pool.checksum` checksums of every tensor of the checkpoint, over its stored bytes
    (:func:`tensor_bytes`). Cost: one full read of the weights. Raises :class:`CheckpointError`
    like :func:`tensor_bytes`."""
    out: dict[str, Checksum] = {}
    for spec, data in tensor_bytes(directory):
        itemsize = 1 if spec.dtype in ONE_BYTE_DTYPES else 2
        try:
            plain, weighted = words_checksum(data, itemsize)
        except ValueError as e:  # a byte count that is not whole words
            raise CheckpointError(f"tensor {spec.name!r}: {e}", path=str(directory)) from e
        out[spec.name] = Checksum(spec.dtype, spec.shape, plain, weighted)
    return out


#: dtypes of one byte per element (every other dtype is read as 16-bit words)
ONE_BYTE_DTYPES = frozenset(
    {"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "int8", "uint8", "bool"}
)
