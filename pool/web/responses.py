"""JSON answers: the one serializer of both services."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web


def dumps(obj: Any) -> str:
    """Compact JSON (the one serializer of both services)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(
        text=dumps(body), status=status, content_type="application/json", headers=headers
    )
