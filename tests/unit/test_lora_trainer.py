"""The trainer's side of LoRA generations: what PEFT saves is what the pool's preflight accepts,
and the probe of an adapter is computed on its base (``rolloutpool push --base``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pool.adapters import read_adapter
from pool.checkpoint import read_manifest
from rolloutpool.local.models import ensure_model, marker_token
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


class RecordingUpdater:
    """What PoolLink calls on its UpdaterClient, recorded; every update succeeds."""

    def __init__(self) -> None:
        self.pushed: list[tuple[Path, dict[str, list[int]]]] = []

    def push(self, checkpoint: Path, *, probe: Any, **kw: Any) -> dict[str, Any]:
        self.pushed.append((Path(checkpoint), probe))
        n = len(self.pushed)
        return {"id": f"up-{n}", "generation": n, "label": kw["label"], "identity_digest": "w"}

    def wait(self, update_id: str, timeout_s: float) -> dict[str, Any]:
        return {"id": update_id, "state": "succeeded", "replicas": {}}

    def close(self) -> None:
        pass


def test_pool_link_pushes_a_peft_models_adapter(tmp_path: Path) -> None:
    """PoolLink with a PEFT model: the pushed directory is the adapter (what a LoRA pool takes),
    its probe the adapted model's greedy output."""
    import torch
    from transformers import AutoModelForCausalLM

    from rolloutpool.integrations.trl import PoolLink

    base = ensure_model("lora-base")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["o_proj"]))
    link = PoolLink("http://127.0.0.1:9", "http://127.0.0.1:9", checkpoint_dir=tmp_path, run="r")
    fake = RecordingUpdater()
    link._updater = fake  # type: ignore[assignment]
    try:
        link._push(adapted, None, step=3)
    finally:
        link.close()
    ((ckpt, probe),) = fake.pushed
    assert (ckpt / "adapter_config.json").is_file()
    info = read_adapter(ckpt, read_manifest(base), max_rank=16)
    assert info.modules == ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj")
    prompt, expected = probe_from_adapter(ckpt, base, n_tokens=4, seed=3)
    assert (list(probe[0]), list(probe[1])) == (prompt, expected)
    assert link.updates[0].checkpoint == str(ckpt)


def test_push_finds_the_base_of_an_adapter_or_asks_for_it(tmp_path: Path) -> None:
    from rolloutpool.errors import CliError, ExitCode
    from rolloutpool.push import _adapter_base

    base = ensure_model("lora-base")
    adapter = ensure_model("lora-marker", token_id=marker_token(1))
    assert _adapter_base(base, None) is None  # a full checkpoint: no base needed
    assert _adapter_base(adapter, base) == base
    with pytest.raises(CliError) as e:  # its config names a base that is not a directory here
        _adapter_base(adapter, None)
    assert e.value.exit_code == ExitCode.USAGE and "--base" in str(e.value)
    named = tmp_path / "named"
    named.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(
        json.dumps({**cfg, "base_model_name_or_path": str(base)})
    )
    assert _adapter_base(named, None) == base
