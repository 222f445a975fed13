"""The tiny models' tokenizer: it carries a chat template (vLLM answers chat completions with
it, nothing passed on its command line) and its vocabulary is the one the marker checkpoints,
probes and token-id tests were written against."""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutpool.local.models import CHAT_TEMPLATE, ensure_model, marker_token

#: sha256 of the trained vocabulary, merges and special tokens (ids 0-2: <s> </s> <pad>).
VOCAB_DIGEST = "7b7a116c9c384899fc758b52a618f6f53ca2754496969afe6d63fefd9153ba36"


def _tokenizer(directory: Path) -> Any:
    transformers: Any = importlib.import_module("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("kind", ["random", "marker"])
def test_every_tiny_model_renders_a_chat_with_its_own_template(kind: str) -> None:
    model = (
        ensure_model("random", seed=1)
        if kind == "random"
        else ensure_model("marker", token_id=marker_token(1))
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE  # where every transformers version reads it
    tok = _tokenizer(model)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>system\nbe brief</s>\n<s>user\nhello there</s>\n<s>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(0) == 3 and ids.count(1) == 2  # the turn markers are <s> and </s>
    assert tok.eos_token_id == 1  # the assistant's turn ends where the model stops


def test_the_vocabulary_is_the_one_the_markers_were_written_against() -> None:
    data = json.loads((ensure_model("tokenizer") / "tokenizer.json").read_text())
    model = data["model"]
    blob = json.dumps(
        {"vocab": model["vocab"], "merges": model["merges"], "added": data["added_tokens"]},
        sort_keys=True,
    )
    assert hashlib.sha256(blob.encode()).hexdigest() == VOCAB_DIGEST
    assert [t["content"] for t in data["added_tokens"]] == ["<s>", "</s>", "<pad>"]
