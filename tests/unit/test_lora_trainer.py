"""The trainer's side of LoRA generations: what PEFT saves is what the pool's preflight accepts,
and the probe of an adapter is computed on its base (``rolloutpool push --base``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pool.adapters import read_adapter
from pool.checkpoint import read_manifest
from testkit.models import ensure_model, marker_token
from updater.probe import probe_from_adapter, probe_from_model

peft: Any = pytest.importorskip("peft")


def test_a_peft_models_saved_adapter_passes_the_preflight(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    base = ensure_model("lora-base")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    adapted = peft.get_peft_model(model, config)
    adapted.save_pretrained(str(tmp_path))
    info = read_adapter(tmp_path, read_manifest(base), max_rank=8)
    assert info.rank == 4 and len(info.modules) == 4  # q_proj and v_proj of 2 layers
    prompt, expected = probe_from_model(adapted, n_tokens=4)
    assert len(prompt) == 16 and len(expected) == 4


def test_an_adapters_probe_is_its_marker_on_the_base() -> None:
    base = ensure_model("lora-base")
    adapter = ensure_model("lora-marker", token_id=marker_token(3))
    _, expected = probe_from_adapter(adapter, base, n_tokens=4)
    assert expected == [marker_token(3)] * 4
