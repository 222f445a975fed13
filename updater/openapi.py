"""The updater's OpenAPI 3.1 document, built from the pydantic models the handlers validate with
(and the HTTP kit's shared pieces, :mod:`pool.web.openapi`).

``tests/unit/test_updater_openapi.py`` keeps it in sync with the aiohttp route table: every
route is documented and every documented operation exists.
"""

from __future__ import annotations

from typing import Any

from pool.records import UpdateRecord
from pool.web import openapi as kit
from pool.web.openapi import ADMIN, PUBLIC, error_responses, json_content, model_schemas, ref
from updater.api import UpdateRequest

MAX_LIST = 1000  # GET /v1/updates?limit= (enforced by the handler)
_TEXT = {
    400: "bad JSON or query",
    401: "no admin token",
    403: "wrong token or admin disabled",
    404: "unknown update",
    409: "state conflict",
    422: "validation or preflight failed",
    503: "Redis unreachable",
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_responses(_TEXT, *codes)


def document() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/updates": {
            "post": {
                "operationId": "push_update",
                "security": ADMIN,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref("UpdateRequest")}},
                },
                "responses": {
                    "202": {
                        **json_content(ref("UpdateRecord"), "queued"),
                        "headers": {"Location": {"schema": {"type": "string"}}},
                    },
                    **_errors(400, 401, 403, 409, 422, 503),
                },
            },
            "get": {
                "operationId": "list_updates",
                "security": ADMIN,
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST},
                    }
                ],
                "responses": {
                    "200": json_content(
                        {
                            "type": "object",
                            "required": ["updates"],
                            "properties": {
                                "updates": {"type": "array", "items": ref("UpdateRecord")}
                            },
                        },
                        "newest first",
                    ),
                    **_errors(400, 401, 403, 503),
                },
            },
        },
        "/v1/updates/{id}": {
            "get": {
                "operationId": "get_update",
                "security": ADMIN,
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": json_content(ref("UpdateRecord"), "the update"),
                    **_errors(401, 403, 404, 503),
                },
            }
        },
        **kit.common_paths(pool_security=PUBLIC, pool_errors=_errors(503)),
    }
    return kit.document(
        title="RolloutPool updater",
        description="Push checkpoints; follow rolling updates.",
        paths=paths,
        schemas=model_schemas(UpdateRequest, UpdateRecord),
    )
