"""JSON answers: the one serializer of both services (orjson; the standard library where
orjson cannot: integers beyond 64 bits, non-finite floats from a peer's JSON)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumpb(obj: Any) -> bytes:
    """Compact JSON as UTF-8 bytes (raw UTF-8, no ASCII escapes)."""
    try:
        return orjson.dumps(obj, option=_OPTIONS)
    except TypeError:  # an integer orjson cannot represent, or a type it does not know
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def dumps(obj: Any) -> str:
    """Compact JSON (the one serializer of both services)."""
    return dumpb(obj).decode()


def loads(raw: bytes | str) -> Any:
    """A peer's JSON (a replica's answer): orjson, or the standard library for what orjson
    refuses but Python's parser reads (``NaN``, ``Infinity``, lone surrogates). Raises
    :class:`ValueError`. Client bodies go through :func:`pool.web.bodies.parse_json` (strict)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=dumpb(body),
        status=status,
        content_type="application/json",
        charset="utf-8",
        headers=headers,
    )
