"""The LoRA routes of one vLLM server, on :class:`~pool.engine.VllmEngine`'s seam.

The server must run with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (without
it the load and unload routes are not mounted: 404). Errors follow the table of
:mod:`pool.engine`; loading and unloading are mutating calls, listing and probing read-only.

What vLLM 0.32 answers (observed on CPU): a load returns 200 with a plain-text body, 400 for a
name already loaded, 404 for a path with no adapter, 500 when the worker refuses it (a rank above
``--max-lora-rank``, a target module the model lacks); the name is then not listed. An unload
returns 200, or 404 for a name it does not have. ``GET /v1/models`` lists each adapter as a
model whose ``parent`` is the base model and ``root`` its path. A server holds more adapters than
``--max-loras`` (that many run in one batch; the others wait and are swapped in from their
files), so an adapter's files must stay unchanged while it is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pool.engine import VllmEngine
from pool.errors import NoMutation

__all__ = ["load_adapter", "probe_adapter", "served_adapters", "unload_adapter"]


async def load_adapter(engine: VllmEngine, name: str, path: str, *, timeout_s: float) -> None:
    """``POST /v1/load_lora_adapter``: serve the adapter in ``path`` as ``name`` beside the
    others. Raises ``NoMutation`` (refused, 4xx) or ``AmbiguousMutation`` (5xx, no answer):
    the caller finds out what the server holds with :func:`served_adapters`."""
    body = {"lora_name": name, "lora_path": path}
    await engine._call(
        "POST", "/v1/load_lora_adapter", mutating=True, timeout_s=timeout_s, json=body
    )


async def unload_adapter(engine: VllmEngine, name: str, *, timeout_s: float) -> bool:
    """``POST /v1/unload_lora_adapter``. True: vLLM removed it; False: it did not hold
    ``name`` (404). Any other failure raises as the table says."""
    try:
        await engine._call(
            "POST",
            "/v1/unload_lora_adapter",
            mutating=True,
            timeout_s=timeout_s,
            json={"lora_name": name},
        )
    except NoMutation as e:
        if e.context.get("status") == 404:
            return False
        raise
    return True


async def served_adapters(engine: VllmEngine, *, timeout_s: float) -> dict[str, str]:
    """The adapters the server lists (``GET /v1/models`` entries with a ``parent``): name ->
    path. Read-only."""
    r = await engine._call("GET", "/v1/models", mutating=False, timeout_s=timeout_s)
    data = engine._body(r, mutating=False).get("data")
    if not isinstance(data, list):
        raise engine._unexpected(r, "no 'data' list", mutating=False)
    out: dict[str, str] = {}
    for m in data:
        if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str):
            out[m["id"]] = str(m.get("root") or "")
    return out


async def probe_adapter(
    engine: VllmEngine,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    timeout_s: float,
) -> tuple[tuple[int, ...], str | None]:
    """A greedy completion of ``prompt`` through ``model`` (an adapter or the base), with a
    salt of its own so no cached block of another request is reused. Returns the generated
    token ids and the ``model`` the answer names. Read-only."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
        "cache_salt": "rolloutpool-probe",
    }
    r = await engine._call(
        "POST", "/v1/completions", mutating=False, timeout_s=timeout_s, json=body
    )
    answer = engine._body(r, mutating=False)
    try:
        ids = answer["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise engine._unexpected(r, "no choices[0].token_ids", mutating=False)
    named = answer.get("model")
    return tuple(ids), named if isinstance(named, str) else None
