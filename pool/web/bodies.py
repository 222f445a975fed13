"""Reading a request body: size limit, JSON, object shape (400/413)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pool.web.errors import BadRequest, PayloadTooLarge


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
