"""Validation probes computed on the trainer side from the trainer's own model (torch, CPU or GPU).

A probe is (prompt token ids, the greedy token ids the new weights must produce). vLLM and the
trainer's framework do not compute bit-identical logits, so a greedy step whose top-1 and top-2
logits are nearly tied could flip between them. :func:`probe_from_model` therefore only accepts
prompts where every greedy step wins by at least ``margin`` (in logits); it tries deterministic
candidate prompts until one qualifies. With fp32 on both sides a margin of 0.05 is far above
the numerical noise (~1e-5).

Imports torch lazily: ``updater`` itself does not need it.
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from typing import Any

from pool.errors import RolloutPoolError


class ProbeError(RolloutPoolError):
    code = "probe_error"


def _greedy_with_margin(model: Any, prompt: list[int], n_tokens: int) -> tuple[list[int], float]:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    out: list[int] = []
    worst = float("inf")
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = model(input_ids=ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            worst = min(worst, float(top.values[0] - top.values[1]))
            nxt = int(top.indices[0])
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out, worst


def probe_from_model(
    model: Any,
    *,
    n_tokens: int = 8,
    prompt_len: int = 16,
    vocab_low: int = 3,
    vocab_high: int | None = None,
    margin: float = 0.05,
    tries: int = 64,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """(prompt, expected greedy tokens) for ``model`` (a causal LM returning ``.logits``).

    Raises :class:`ProbeError` if no candidate prompt has every step decided by ``margin``.
    """
    high = vocab_high or int(model.config.vocab_size)
    rng = random.Random(seed)
    was_training = bool(getattr(model, "training", False))
    model.eval()
    best = -1.0
    try:
        for _ in range(tries):
            prompt = [rng.randrange(vocab_low, high) for _ in range(prompt_len)]
            tokens, worst = _greedy_with_margin(model, prompt, n_tokens)
            if worst >= margin:
                return prompt, tokens
            best = max(best, worst)
    finally:
        if was_training:
            model.train()
    raise ProbeError(
        f"no probe prompt decided every greedy step by >= {margin} (best {best:.4f}); "
        "the model's greedy output is too close to a tie to validate against",
        margin=margin,
    )


def probe_from_checkpoint(checkpoint: Path, **kw: Any) -> tuple[list[int], list[int]]:
    """Load ``checkpoint`` with transformers (float32, CPU) and compute its probe."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    return probe_from_model(model, **kw)


def probe_from_adapter(adapter: Path, base: Path, **kw: Any) -> tuple[list[int], list[int]]:
    """Load the ``base`` model with transformers and the PEFT LoRA ``adapter`` onto it (float32,
    CPU; needs the ``peft`` package), and compute the probe of the adapted model."""
    import torch
    from transformers import AutoModelForCausalLM

    peft: Any = importlib.import_module("peft")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return probe_from_model(peft.PeftModel.from_pretrained(model, str(adapter)), **kw)
