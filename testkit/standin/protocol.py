"""vLLM 0.32's wire format as the stand-in speaks it: request bodies, error bodies, responses.

Everything here is pure (no I/O). Shapes were captured from a real vLLM CPU 0.32.0 server and
are pinned by ``tests/integration/test_standin_conformance.py``:

* request bodies are pydantic models that accept (and ignore) fields the stand-in does not
  model (logprobs, stop strings, tools, ...), as vLLM ignores unknown fields;
* errors: a schema violation is 400 ``{"error": {"message": "N validation error(s): ...",
  "type": "Bad Request", "param": "body.<field>", "code": 400}}``; a semantic one (vLLM's
  ``VLLMValidationError``) is 400 with type ``BadRequestError`` and the message ending in
  ``(parameter=..., value=...)``; an unknown model is 404 ``NotFoundError``; framework errors
  (an unknown route) are ``{"detail": "Not Found"}``;
* responses carry vLLM's null fields (``logprobs``, ``routed_experts``, ``kv_transfer_params``,
  ...) so a client sees the same key sets; streamed chunks are SSE ``data:`` events ending with
  ``data: [DONE]``, the usage chunk (``stream_options.include_usage``) has ``choices: []``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ApiError",
    "ChatBody",
    "CompletionBody",
    "GenerateBody",
    "dumps",
    "semantic_error",
    "validation_error",
]

_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_CACHE_SALT = 128


def dumps(obj: Any) -> str:
    """Compact JSON with raw UTF-8, as vLLM (starlette / pydantic) writes it."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class ApiError(Exception):
    """An HTTP error answer: ``status`` and the JSON ``body``."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = dict(body)


def error(status: int, message: str, err_type: str, param: str | None = None) -> ApiError:
    body = {"message": message, "type": err_type, "param": param, "code": status}
    return ApiError(status, {"error": body})


def semantic_error(message: str, param: str | None = None, value: Any = None) -> ApiError:
    """vLLM's ``VLLMValidationError``: 400 ``BadRequestError``, the parameter in the message."""
    if param is not None:
        message += f" (parameter={param}" + ("" if value is None else f", value={value}") + ")"
    return error(400, message, "BadRequestError", param)


def http_error(status: int, detail: str) -> ApiError:
    """FastAPI's ``HTTPException`` through vLLM's handler: the status phrase as the type."""
    return error(status, detail, HTTPStatus(status).phrase)


def not_found_model(model: str, served: str) -> ApiError:
    msg = f"The model `{model}` does not exist. Valid aliases: {served}."
    return error(404, msg, "NotFoundError", "model")


def _summary(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, dict, set)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def validation_error(exc: ValidationError, where: str = "body") -> ApiError:
    """A pydantic failure rendered as vLLM's ``RequestValidationError`` handler does."""
    errors = exc.errors(include_url=False)
    parts = []
    for e in errors[:10]:
        loc = ".".join([where, *(str(p) for p in e["loc"] if not _internal(str(p)))])
        item: dict[str, Any] = {"type": e["type"], "loc": loc, "msg": e["msg"]}
        item["input"] = _summary(e.get("input"))
        if "ctx" in e:
            item["ctx"] = {k: str(v) for k, v in e["ctx"].items()}
        parts.append(str(item))
    first = errors[0]["loc"] if errors else ()
    param = ".".join([where, *(str(p) for p in first if not _internal(str(p)))])
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {p}" for p in parts)
    return error(400, message, "Bad Request", param)


def json_error(exc: ValueError, pos: int) -> ApiError:
    item: dict[str, Any] = {"type": "json_invalid", "loc": f"body.{pos}"}
    item.update(msg="JSON decode error", input="<dict of 0 items>")
    item["ctx"] = {"error": str(exc).split(":")[0]}
    return error(400, f"1 validation error:\n  {item}", "Bad Request", f"body.{pos}")


def _internal(segment: str) -> bool:
    """pydantic's union-branch markers (``list[int]``, ``str``...) that vLLM drops from ``loc``."""
    return any(c in segment for c in "[]{}()") or segment in {"str", "int", "list", "dict"}


def check_cache_salt(salt: Any) -> None:
    """vLLM 0.32: a non-empty string of at most 128 characters without ``@ / \\`` or NUL."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise semantic_error(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > MAX_CACHE_SALT or _SALT_FORBIDDEN & set(salt):
        raise semantic_error(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


# ---------------------------------------------------------------------------------- bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
    temperature: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)


class _Request(_Sampling):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Any = None
    return_token_ids: bool | None = None
    #: vLLM 0.33+: per-choice ``weight_versions`` on completions
    return_weight_versions: bool = False


class CompletionBody(_Request):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    max_tokens: int | None = 16


class ChatBody(_Request):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class SamplingParams(_Sampling):
    max_tokens: int | None = 16


class GenerateBody(_Body):
    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Any = None
    return_token_ids: bool | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


# ---------------------------------------------------------------------------------- responses


def usage(prompt: int, completion: int, *, details: bool = True) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        u.update(prompt_tokens_details=None, completion_tokens_details=None)
    return u


def spans_json(spans: list[list[str | int]]) -> list[dict[str, Any]]:
    return [{"version": v, "start": s, "end": e} for v, s, e in spans]


def completion_choice(
    index: int,
    text: str,
    finish: str | None,
    token_ids: list[int] | None,
    prompt_ids: list[int] | None,
    spans: list[list[str | int]] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "routed_experts": None,
    }
    if spans is not None:
        choice["weight_versions"] = spans_json(spans)
    return choice


def chat_choice(
    index: int,
    text: str,
    finish: str | None,
    token_ids: list[int] | None,
    spans: list[list[str | int]] | None,
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": None,
    }
    if spans is not None:
        choice["weight_versions"] = spans_json(spans)
    return choice


def generate_choice(
    index: int,
    finish: str | None,
    token_ids: list[int],
    spans: list[list[str | int]] | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": token_ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None if spans is None else spans_json(spans),
        "logprobs": None,
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    fingerprint: str,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    chat: bool = False,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(prompt_tokens, completion_tokens),
    }
    if chat:
        body.update(prompt_logprobs=None, prompt_token_ids=prompt_ids, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


def generate_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    prompt_ids: list[int] | None,
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "model": model,
        "created": created,
        "usage": usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": choices,
    }
