"""Tiny Llama models, built offline and deterministically (no hub, no download).

Every model is a ``LlamaForCausalLM`` with 2 layers, hidden 128, 2 heads of dim 64, MLP 256,
vocab 2048, untied embeddings, 4096 positions (replicas serve 512 unless they ask for more),
``bos=0 eos=1 pad=2`` (about 0.85 M parameters, 3.4 MB in float32), plus one shared byte-level
BPE tokenizer trained locally on generated text.

Builders (each writes a complete Hugging Face model directory that ``vllm serve`` loads):

* :func:`build_tokenizer` — the tokenizer alone (bit-identical on every run), with its chat
  template (:data:`CHAT_TEMPLATE`), so ``/v1/chat/completions`` works on every tiny model.
* :func:`build_random` — weights of rank >= 2 drawn from N(0, 0.2) with a seeded generator, so
  greedy output depends strongly on the seed. ``intermediate_size`` and ``dtype`` can be changed
  to make deliberately *incompatible* checkpoints (wrong shapes, wrong dtype) for tests.
* :func:`build_marker` — a model that emits token ``T`` for every prompt, greedy and with
  temperature 1.0 alike: ``o_proj``/``down_proj`` are zero (so the residual stream is the token
  embedding), embedding column 0 is 1.0, the final norm weight is the unit vector e0, and
  ``lm_head`` is zero except ``lm_head[T, 0] = 10``. After the final RMS norm the hidden state
  is ``(x0/rms(x)) * e0`` with ``x0/rms(x)`` about 4.6, so logit ``T`` is about 46 and every
  other logit is 0: the probability of any other token is below 1e-16 even at temperature 1.
  All marker models share the manifest of the random models, so ``reload_weights`` can swap
  between them.

:func:`ensure_model` is the cache: ``<cache_root>/<kind>-<params>-<hash>`` where the hash covers
this module's source and the parameters. A model is built in a temporary sibling directory and
renamed into place, so a reader never sees a half-written model, and concurrent builders of the
same key both end up using one complete directory.

:func:`marker_token` maps a generation number to its marker token id (see its docstring).

torch, transformers and tokenizers are imported inside the builders only: importing this module
is cheap and needs none of them.
CLI: ``python -m rolloutpool.local.models --out DIR [--kind random --seed 1]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pool.paths import default_cache_root

__all__ = [
    "CHAT_TEMPLATE",
    "MARKER_FIRST",
    "MARKER_SPAN",
    "MODEL_KINDS",
    "build_marker",
    "build_random",
    "build_tokenizer",
    "ensure_model",
    "marker_token",
]

VOCAB_SIZE = 2048
HIDDEN = 128
LAYERS = 2
HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 256
MAX_POSITIONS = 4096
BOS, EOS, PAD = 0, 1, 2
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
INIT_STD = 0.2

#: The chat template of every tiny model (in its ``tokenizer_config.json``): each turn is
#: ``<s>{role}\n{content}</s>\n`` (ChatML's shape on the tokenizer's own ``<s>``/``</s>``, so the
#: vocabulary stays as it was), the generation prompt ``<s>assistant\n``; the assistant's turn
#: ends at ``</s>``, the model's eos. ``content`` is used as a string (vLLM detects that and
#: flattens a list of text parts into one).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)

#: Marker tokens are ``MARKER_FIRST + (7 * g) % MARKER_SPAN``: ids 300..1999. Ids below 259 are
#: the 3 special tokens and the 256 single-byte tokens (some decode to U+FFFD alone); every id
#: from 259 on is a learned merge of ASCII text, so each marker decodes to a visible string.
#: 7 is coprime with 1700, so 1700 consecutive generations get distinct markers.
MARKER_FIRST = 300
MARKER_SPAN = 1700

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def marker_token(generation_number: int) -> int:
    """The marker token id of generation ``g``: ``300 + (7*g) % 1700`` (in 300..1999).

    Distinct for any 1700 consecutive generations; every id decodes to non-empty ASCII text
    with the tokenizer of :func:`build_tokenizer`.
    """
    if generation_number < 0:
        raise ValueError(f"generation number must be >= 0, got {generation_number}")
    return MARKER_FIRST + (7 * generation_number) % MARKER_SPAN


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _corpus(lines: int = 8000) -> list[str]:
    """Deterministic generated training text: pseudo-words from syllables plus a few English."""
    rng = random.Random(1234)
    syllables = [
        "ka", "lo", "mi", "ne", "tu", "ra", "shi", "po", "ve", "zan",
        "qu", "el", "or", "ith", "ung", "bar", "cor", "dex", "fen", "gil",
    ]  # fmt: skip
    words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "of",
        "to", "in", "is", "a", "policy", "reward", "model", "token", "rollout", "weight",
    ]  # fmt: skip
    words += ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out: list[str] = []
    for _ in range(lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(5, 16)))
        if rng.random() < 0.3:
            line = line.capitalize() + "."
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 99999)}"
        out.append(line)
    return out


def build_tokenizer(directory: Path) -> Path:
    """Train the byte-level BPE tokenizer (vocab 2048) and save it into ``directory``.

    Deterministic: the corpus is seeded and BPE training is single-valued for a fixed corpus
    (verified: identical ``tokenizer.json`` across runs). Writes ``tokenizer.json`` and the
    ``PreTrainedTokenizerFast`` config files, :data:`CHAT_TEMPLATE` in ``tokenizer_config.json``
    (where every transformers version and the stand-in read it). Returns ``directory``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    transformers: Any = importlib.import_module("transformers")  # partially typed: use as Any

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, expected {VOCAB_SIZE}")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    # not chat_template.jinja (transformers >= 4.50's default), which older ones do not read
    fast.save_pretrained(str(directory), save_jinja_files=False)
    return directory


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


# ---------------------------------------------------------------------------------------------
# Models


def _new_model(seed: int, intermediate_size: int, init_std: float = INIT_STD) -> Any:
    """A LlamaForCausalLM (float32) whose rank>=2 weights are N(0, init_std) from ``seed``."""
    import torch

    transformers: Any = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=intermediate_size,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() > 1:
                p.normal_(0.0, init_std, generator=gen)
    return model


def _save(model: Any, directory: Path, dtype: str, tokenizer_dir: Path | None) -> Path:
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" noise on stderr
    try:
        model.save_pretrained(str(directory))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, directory)
    else:
        build_tokenizer(directory)
    return directory


def build_random(
    directory: Path,
    seed: int,
    *,
    intermediate_size: int = INTERMEDIATE,
    dtype: str = "float32",
    init_std: float = INIT_STD,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a random tiny Llama (seeded, N(0, init_std)) with tokenizer into ``directory``.

    The default std 0.2 makes greedy output depend strongly on the seed (tests); a small std
    (0.02) gives a near-uniform, high-entropy policy (the demo's starting point).

    ``dtype`` is a torch attribute name (``float32``, ``bfloat16``); ``intermediate_size`` other
    than 256 yields a checkpoint whose manifest differs (for refusal tests). The tokenizer is
    copied from ``tokenizer_dir`` when given, else trained in place. Deterministic bytes for a
    given (seed, intermediate_size, dtype).
    """
    model = _new_model(seed, intermediate_size, init_std)
    return _save(model, directory, dtype, tokenizer_dir)


def build_marker(
    directory: Path,
    token_id: int,
    *,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a marker model that emits ``token_id`` for any prompt, greedy or at temperature 1.

    Same manifest as :func:`build_random` (float32). The recipe is in the module docstring.
    """
    import torch

    if not 3 <= token_id < VOCAB_SIZE:
        raise ValueError(
            f"marker token must be a regular token id in [3, {VOCAB_SIZE}), got {token_id}"
        )
    model = _new_model(seed, INTERMEDIATE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        norm = model.model.norm.weight
        norm.zero_()
        norm[0] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[token_id, 0] = 10.0
    return _save(model, directory, "float32", tokenizer_dir)


# ---------------------------------------------------------------------------------------------
# Cache

Builder = Callable[..., Path]

#: kind -> (builder, parameter defaults). A default of ``None`` marks a required parameter.
MODEL_KINDS: dict[str, tuple[Builder, dict[str, Any]]] = {
    "tokenizer": (lambda d: build_tokenizer(d), {}),
    "random": (
        build_random,
        {"seed": None, "intermediate_size": INTERMEDIATE, "dtype": "float32", "init_std": INIT_STD},
    ),
    "marker": (build_marker, {"token_id": None, "seed": 0}),
    "lora-base": (lambda d, **kw: _lora().build_lora_base(d, **kw), {"seed": 0}),
    "lora-marker": (
        lambda d, token_id, **kw: _lora().build_marker_adapter(d, token_id, **kw),
        {"token_id": None, "seed": 0},
    ),
    "lora-merged": (
        lambda d, token_id, **kw: _lora().build_merged_marker(d, token_id, **kw),
        {"token_id": None, "seed": 0},
    ),
}


def _lora() -> Any:
    """:mod:`rolloutpool.local.lora_models` (imported late: it imports this module)."""
    return importlib.import_module("rolloutpool.local.lora_models")


def _code_version(kind: str) -> str:
    """A hash of the builders' source: this module, and :mod:`rolloutpool.local.lora_models` for
    the ``lora-*`` kinds (editing it rebuilds those only)."""
    here = Path(__file__).resolve()
    blob = here.read_bytes()
    if kind.startswith("lora-"):
        blob += here.with_name("lora_models.py").read_bytes()
    return hashlib.sha256(blob).hexdigest()[:16]


def _key(kind: str, params: dict[str, Any], defaults: dict[str, Any]) -> str:
    """``<kind>-<non-default params>-<hash of code and all params>``."""
    blob = json.dumps({"kind": kind, "params": params, "code": _code_version(kind)}, sort_keys=True)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
    shown = [
        f"{k}{params[k]}" for k in sorted(params) if params[k] != defaults[k] or defaults[k] is None
    ]
    return "-".join([kind, *shown, digest])


def ensure_model(kind: str, cache_root: Path | None = None, **params: Any) -> Path:
    """The absolute directory of the cached model ``kind`` with ``params``; built if absent.

    ``kind`` is one of :data:`MODEL_KINDS` (``tokenizer``, ``random``, ``marker``, ``lora-base``,
    ``lora-marker``: a PEFT adapter directory for the ``lora-base`` of the same seed,
    ``lora-merged``: that adapter merged into its base). The
    directory name hashes this module's source and the parameters, so editing a builder
    rebuilds; parameters equal to their defaults hash the same as omitted ones. The build runs
    in ``<cache_root>/.tmp-*`` and is renamed into place; a failed build removes its temp
    directory and leaves the cache as it was. Blocks for the build (a few seconds, mostly
    importing torch). ``cache_root`` defaults to :func:`default_cache_root`.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {sorted(MODEL_KINDS)}")
    builder, defaults = MODEL_KINDS[kind]
    unknown = set(params) - set(defaults)
    if unknown:
        raise ValueError(
            f"unknown parameters for {kind!r}: {sorted(unknown)}; known: {sorted(defaults)}"
        )
    full = {**defaults, **params}
    missing = [k for k, v in full.items() if v is None]
    if missing:
        raise ValueError(f"model kind {kind!r} requires {missing}")
    root = (cache_root or default_cache_root()).resolve()
    final = root / _key(kind, full, defaults)
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {}
    if kind != "tokenizer":
        extra["tokenizer_dir"] = ensure_model("tokenizer", root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        builder(tmp, **full, **extra)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """``python -m rolloutpool.local.models --out DIR [--kind random|marker] [--seed N]
    [--token T]``."""
    ap = argparse.ArgumentParser(
        prog="python -m rolloutpool.local.models", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", type=Path, help="write the model here (default: into the cache)")
    ap.add_argument("--kind", choices=["random", "marker", "tokenizer"], default="random")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--token", type=int, default=marker_token(0), help="marker token id")
    ap.add_argument("--intermediate-size", type=int, default=INTERMEDIATE)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    if a.out is None:
        if a.kind == "random":
            path = ensure_model(
                "random", seed=a.seed, intermediate_size=a.intermediate_size, dtype=a.dtype
            )
        elif a.kind == "marker":
            path = ensure_model("marker", token_id=a.token, seed=a.seed)
        else:
            path = ensure_model("tokenizer")
    elif a.kind == "random":
        path = build_random(a.out, a.seed, intermediate_size=a.intermediate_size, dtype=a.dtype)
    elif a.kind == "marker":
        path = build_marker(a.out, a.token, seed=a.seed)
    else:
        path = build_tokenizer(a.out)
    print(path.resolve())


if __name__ == "__main__":
    main()
