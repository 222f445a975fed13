"""Reading a request body (size limit, JSON, object shape: 400/413) and validating it strictly."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from pool.web.errors import BadRequest, PayloadTooLarge

M = TypeVar("M", bound=BaseModel)


async def read_json_object(
    request: web.Request, limit: int, *, optional: bool = False
) -> dict[str, Any]:
    """The body as a JSON object. ``optional``: an empty body is ``{}``.

    Raises :class:`~pool.web.errors.PayloadTooLarge` (413) above ``limit`` bytes — before
    reading when the Content-Length says so — and :class:`~pool.web.errors.BadRequest` (400)
    for invalid JSON or a non-object.
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
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}", code="invalid_json") from e
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
