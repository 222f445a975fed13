"""What a stand-in replica "serves": a checkpoint directory reduced to an identity and a token
function, plus the tokenizer of the served model.

The stand-in runs no model. A checkpoint is read once (:func:`load_weights`, cached by file
names, sizes and modification times) and becomes :class:`Weights`:

* ``identity``: 16 bytes of BLAKE2b over ``config.json`` and every safetensors file (names,
  sizes, bytes), so two checkpoints generate the same tokens iff their bytes are equal;
* ``marker``: for the project's marker models (:func:`rolloutpool.local.models.build_marker`:
  ``lm_head`` is zero except one positive entry in row ``T``) the token ``T`` they emit for any
  prompt and any temperature, as the real model does; ``None`` for any other checkpoint;
* ``vocab_size`` and ``eos_token_id`` from ``config.json``;
* ``eos_prob``: ``marker_eos_prob`` from ``config.json`` (0.0 if absent), set by the strategies
  benchmark's markers (:mod:`testkit.scenarios.strategies.models`), whose ``lm_head`` has a second
  nonzero entry in the EOS row so that vLLM samples EOS with that probability per token at
  temperature > 0.

Tokens (:func:`plan_tokens`): a marker checkpoint emits its marker (sampled, with ``eos_prob``
> 0: each token EOS with that probability instead, from the request's nonce); any other emits, from
position ``start`` on, a pseudo-random sequence seeded by (identity, prompt, ``start``, the
sampling nonce for temperature > 0, and the identities of weights whose stale KV the request
reuses). Greedy output is therefore a pure function of (checkpoint bytes, prompt), which
:func:`expected_tokens` computes for validation probes. Tokens are uniform over the vocabulary,
so the EOS token appears about once per ``vocab_size`` tokens (``ignore_eos`` decides whether it
ends the request, as in vLLM).

:class:`Tokenizer` wraps the served model's ``tokenizer.json`` (the ``tokenizers`` library,
shared by every replica of the process that serves the same file). Nothing here blocks on
anything but local file reads; :func:`load_weights` reads the whole checkpoint (3.4 MB for the
tiny models) on a cache miss.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pool.checkpoint import CheckpointError, read_header, safetensors_files

__all__ = [
    "Tokenizer",
    "Weights",
    "WeightsError",
    "expected_tokens",
    "load_weights",
    "plan_tokens",
    "prompt_key",
]

#: Element sizes of the float dtypes a marker's ``lm_head`` may be stored in.
_FLOAT_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
LM_HEAD = "lm_head.weight"


class WeightsError(CheckpointError):
    """The directory is not a loadable checkpoint (missing, no safetensors, no config)."""

    code = "standin_weights_error"


@dataclass(frozen=True)
class Weights:
    """A loaded checkpoint, as far as the stand-in cares."""

    path: Path
    identity: bytes
    marker: int | None
    vocab_size: int
    eos_token_id: int | None
    eos_prob: float = 0.0

    @property
    def digest(self) -> str:
        return self.identity.hex()


def _signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    files = [path / "config.json", *safetensors_files(path)]
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError as e:
            raise WeightsError(f"cannot read {f}: {e}", path=str(path)) from e
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def load_weights(path: Path) -> Weights:
    """The :class:`Weights` of checkpoint directory ``path`` (absolute or not).

    Cached by (path, each file's name, size and mtime). Raises :class:`WeightsError` if the
    directory, its ``config.json`` or its safetensors files are missing or unreadable.
    """
    path = path.expanduser().resolve()
    try:
        signature = _signature(path)
    except CheckpointError as e:
        raise WeightsError(e.message, path=str(path)) from e
    return _load(path, signature)


@lru_cache(maxsize=256)
def _load(path: Path, signature: tuple[tuple[str, int, int], ...]) -> Weights:
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"unreadable config.json in {path}: {e}", path=str(path)) from e
    h = hashlib.blake2b(digest_size=16)
    h.update((path / "config.json").read_bytes())
    marker: int | None = None
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    eos_prob = float(config.get("marker_eos_prob", 0.0))
    for file in safetensors_files(path):
        data = file.read_bytes()
        h.update(f"\0{file.name}\0{len(data)}\0".encode())
        h.update(data)
        header = read_header(file)
        if LM_HEAD in header:
            base = 8 + struct.unpack("<Q", data[:8])[0]
            skip = eos if eos_prob > 0 and isinstance(eos, int) else None
            marker = _marker_row(header[LM_HEAD], data, base, skip_row=skip)
    return Weights(
        path=path,
        identity=h.digest(),
        marker=marker,
        vocab_size=int(config.get("vocab_size", 0)) or 1,
        eos_token_id=eos if isinstance(eos, int) else None,
        eos_prob=eos_prob if marker is not None else 0.0,
    )


def _marker_row(
    entry: dict[str, Any], data: bytes, base: int, *, skip_row: int | None = None
) -> int | None:
    """Row ``T`` if ``lm_head`` (rows = vocabulary) has exactly one nonzero element, positive,
    not counting row ``skip_row`` (the EOS row of a marker with ``marker_eos_prob``)."""
    size = _FLOAT_SIZES.get(entry.get("dtype", ""))
    shape = entry.get("shape")
    if size is None or not isinstance(shape, list) or len(shape) != 2:
        return None
    start, end = entry["data_offsets"]
    blob = data[base + start : base + end]
    if skip_row is not None and 0 <= skip_row < shape[0]:
        row = shape[1] * size
        cleared = bytearray(blob)
        cleared[skip_row * row : (skip_row + 1) * row] = bytes(row)
        blob = bytes(cleared)
    first = len(blob) - len(blob.lstrip(b"\0"))
    last = len(blob.rstrip(b"\0")) - 1
    if first > last or first // size != last // size:
        return None  # all zero, or more than one nonzero element
    element = first // size
    raw = blob[element * size : (element + 1) * size]
    if entry["dtype"] == "F32":
        value = struct.unpack("<f", raw)[0]
    elif entry["dtype"] == "F16":
        value = struct.unpack("<e", raw)[0]
    else:  # BF16: the high half of a float32
        value = struct.unpack("<f", b"\0\0" + raw)[0]
    return element // shape[1] if value > 0 else None


def prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    """16-byte digest of a prompt's token ids (what the token function sees of the prompt)."""
    return hashlib.blake2b(
        struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids), digest_size=16
    ).digest()


def plan_tokens(
    weights: Weights,
    prompt: bytes,
    start: int,
    count: int,
    *,
    nonce: bytes = b"",
    stale: bytes = b"",
) -> list[int]:
    """The ``count`` tokens ``weights`` generate from position ``start`` on.

    ``prompt`` is :func:`prompt_key` of the prompt, ``nonce`` is empty for greedy decoding
    (else a per-request sampling seed), ``stale`` the concatenated identities of other weights
    whose KV cache the request reuses (empty when none). Marker weights ignore all of it.
    """
    if weights.marker is not None:
        if weights.eos_prob <= 0 or not nonce or weights.eos_token_id is None:
            return [weights.marker] * count
        seed = hashlib.blake2b(
            weights.identity + prompt + start.to_bytes(4, "little") + nonce, digest_size=16
        ).digest()
        draw = random.Random(int.from_bytes(seed, "little")).random
        p, eos, marker = weights.eos_prob, weights.eos_token_id, weights.marker
        return [eos if draw() < p else marker for _ in range(count)]
    seed = hashlib.blake2b(
        weights.identity + prompt + start.to_bytes(4, "little") + nonce + stale, digest_size=16
    ).digest()
    bits = random.Random(int.from_bytes(seed, "little")).getrandbits
    vocab = weights.vocab_size
    return [bits(32) % vocab for _ in range(count)]


def expected_tokens(
    checkpoint: Path, prompt_token_ids: Sequence[int], max_tokens: int, *, ignore_eos: bool = True
) -> tuple[int, ...]:
    """The greedy output a stand-in serving ``checkpoint`` returns for this prompt (fresh or
    correctly reset caches): what a validation probe must expect. With ``ignore_eos=False`` the
    output ends after the first EOS token, as the stand-in's does."""
    weights = load_weights(checkpoint)
    tokens = plan_tokens(weights, prompt_key(prompt_token_ids), 0, max_tokens)
    if not ignore_eos and weights.eos_token_id in tokens:
        tokens = tokens[: tokens.index(weights.eos_token_id) + 1]
    return tuple(tokens)


class Tokenizer:
    """The served model's ``tokenizer.json`` (``tokenizers``), shared per file: :meth:`of`."""

    def __init__(self, file: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.file = file
        self._tok = HFTokenizer.from_file(str(file))

    @classmethod
    def of(cls, model: Path) -> Tokenizer | None:
        """The tokenizer in model directory ``model``; ``None`` if it has none."""
        file = (model / "tokenizer.json").resolve()
        return _tokenizer(file) if file.is_file() else None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=True)
        return text

    def stream(self) -> _Detokenizer:
        """An incremental decoder for one streamed output (text emitted as it completes)."""
        return _Detokenizer(self._tok)


class _Detokenizer:
    def __init__(self, tok: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, ids: Sequence[int]) -> str:
        parts = [self._stream.step(self._tok, i) for i in ids]
        return "".join(p for p in parts if p)


@lru_cache(maxsize=16)
def _tokenizer(file: Path) -> Tokenizer:
    return Tokenizer(file)
