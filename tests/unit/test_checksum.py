"""``pool.checksum``: the exact checksum's definition, its backends agreeing bit for bit, what
it detects, and the comparison's evidence. (The Triton kernel is checked against these on the
GPU host, and under ``TRITON_INTERPRET=1`` where Triton is installed.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pool.checkpoint import checkpoint_checksums
from pool.checksum import (
    MODULUS,
    Checksum,
    from_json,
    tensor_checksums,
    to_json,
    words_checksum,
)
from pool.evidence import ChecksumEvidence


def by_definition(t: torch.Tensor) -> tuple[int, int]:
    """The module docstring's formula, one word at a time (slow, obviously right)."""
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    if t.element_size() == 1:
        words = [int(b) - 256 if b > 127 else int(b) for b in raw]
    else:
        words = [int(w) for w in np.frombuffer(raw, "<i2")]
    plain = sum(words)
    weighted = sum(w * (i % MODULUS + 1) for i, w in enumerate(words))
    return plain, weighted


@pytest.mark.parametrize(
    ("n", "dtype"),
    [
        (1, torch.bfloat16),
        (MODULUS + 3, torch.bfloat16),
        (2 * MODULUS, torch.float32),
        (1000, torch.int8),
        (777, torch.float16),
    ],
)
def test_backends_equal_the_definition(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 50).to(dtype)
    want = by_definition(t)
    [got] = tensor_checksums([("t", t)]).values()
    assert (got.plain, got.weighted) == want
    assert (got.dtype, got.shape) == (str(dtype).split(".")[-1], (n,))
    assert (
        words_checksum(t.contiguous().view(torch.uint8).numpy().tobytes(), t.element_size()) == want
    )
    if dtype is not torch.int8:  # the torch fallback, as a CUDA host without Triton runs it
        from pool.checksum import _torch_sums, _words

        assert tuple(_torch_sums(torch, _words(torch, t)).tolist()) == want


def test_detects_one_flipped_bit_a_stale_slice_and_a_shift() -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    base = tensor_checksums([("w", t)])["w"]
    flipped = t.clone()
    flipped.view(torch.int16).view(-1)[1234] ^= 1 << 3
    stale = t.clone()
    stale[60:] = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    shifted = torch.roll(t, 1, dims=0)
    for other in (flipped, stale, shifted):
        assert tensor_checksums([("w", other)])["w"] != base
    assert tensor_checksums([("w", t.clone())])["w"] == base


def test_compare_fails_closed_on_any_difference() -> None:
    a = Checksum("bfloat16", (2, 2), 10, 20)
    sent = {"x": a, "y": a}
    assert ChecksumEvidence.compare(sent, dict(sent)).proves_equal
    cases = {
        "mismatched": {"x": a, "y": Checksum("bfloat16", (2, 2), 10, 21)},
        "missing": {"x": a},
        "unexpected": {"x": a, "y": a, "z": a},
    }
    for kind, seen in cases.items():
        ev = ChecksumEvidence.compare(sent, seen)
        assert not ev.proves_equal and getattr(ev, kind) == 1, kind
        assert ev.examples in (("y",), ("z",))
    assert not ChecksumEvidence.compare({}, {}).proves_equal  # nothing compared proves nothing
    assert not ChecksumEvidence.compare(sent, dict(sent), error="no extension").proves_equal
    assert from_json(to_json(sent)) == sent
    with pytest.raises(ValueError):
        from_json({"x": [1, 2]})


def test_checkpoint_checksums_read_the_stored_bytes(tmp_path: Path) -> None:
    """The ``reload`` sender's side: numpy over the safetensors bytes equals torch over the
    tensors (so the updater needs no torch), and a byte changed on disk changes one checksum."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        "a.weight": torch.randn(33, 7, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.weight": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    sums = checkpoint_checksums(tmp_path)
    assert sums == tensor_checksums(tensors.items())
    blob = bytearray((tmp_path / "model.safetensors").read_bytes())
    blob[-1] ^= 0x01  # the last byte belongs to the last tensor in the file
    (tmp_path / "model.safetensors").write_bytes(bytes(blob))
    changed = checkpoint_checksums(tmp_path)
    assert len([n for n in sums if sums[n] != changed[n]]) == 1
