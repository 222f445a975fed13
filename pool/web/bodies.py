"""Reading a request body (size limit, JSON, object shape: 400/413) and validating it strictly.

What a body may hold is JSON as RFC 8259 has it (nothing a peer's parser could read otherwise):
no ``NaN``/``Infinity`` and no number too large for a double (Python's parser would accept both,
and the router would forward them), nested at most ``MAX_JSON_DEPTH`` levels (deeper bodies
exhaust the interpreter's recursion limit while parsing or re-serializing: a 500 before).
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from pool.web.errors import BadRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)

#: Nesting levels a body may have (vLLM's request bodies, tool schemas included, need a dozen).
MAX_JSON_DEPTH = 64


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large for a double")
    return value


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether ``obj`` nests more than ``limit`` containers deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` as strict JSON (see the module docstring). Raises :class:`BadRequest` (400
    ``invalid_json``) with a message that says what is wrong."""
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError as e:
        raise BadRequest(
            f"invalid JSON: nested more than {max_depth} levels deep", code="invalid_json"
        ) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}", code="invalid_json") from e
    # only a body with that many brackets can be that deep: the walk is skipped for the rest
    if (
        isinstance(value, dict | list)
        and raw.count(b"[") + raw.count(b"{") > max_depth
        and _deeper_than(value, max_depth)
    ):
        raise BadRequest(
            f"invalid JSON: nested more than {max_depth} levels deep", code="invalid_json"
        )
    return value


async def read_json_object(
    request: web.Request, limit: int, *, optional: bool = False
) -> dict[str, Any]:
    """The body as a JSON object. ``optional``: an empty body is ``{}``.

    Raises :class:`~pool.web.errors.PayloadTooLarge` (413) above ``limit`` bytes — before
    reading when the Content-Length says so — and :class:`~pool.web.errors.BadRequest` (400)
    for invalid or non-strict JSON (:func:`parse_json`) or a non-object.
    """
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit}",
            limit=limit,
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise PayloadTooLarge(
            f"request body exceeds the limit of {limit} bytes", limit=limit
        ) from e
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes", limit=limit)
    if not raw.strip():
        if optional:
            return {}
        raise BadRequest("empty body; expected a JSON object", code="invalid_json")
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise BadRequest(
            f"body must be a JSON object, got {type(body).__name__}", code="invalid_body"
        )
    return body


def validate_strictly(model: type[M], raw: Any) -> M:
    """``raw`` (parsed JSON) as ``model``, strictly: a boolean is not an integer and a string is
    not a number. A number with a zero fraction (``1.0``) is the integer JSON Schema says it is.

    Raises :class:`pydantic.ValidationError`.
    """
    return model.model_validate(_integral(raw), strict=True)


def _integral(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v
