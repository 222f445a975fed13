"""The updater's OpenAPI 3.1 document, built from the pydantic models the handlers validate with.

``tests/unit/test_updater_openapi.py`` keeps it in sync with the aiohttp route table: every
route is documented and every documented operation exists.
"""

from __future__ import annotations

from typing import Any

from pool.records import UpdateRecord
from updater.api import UpdateRequest

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "bad JSON",
        401: "no admin token",
        403: "wrong token or admin disabled",
        404: "unknown update",
        409: "state conflict",
        422: "validation or preflight failed",
        503: "Redis unreachable",
    }
    return {str(c): _json(_ref("Error"), text[c]) for c in codes}


def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR}
    for model in (UpdateRequest, UpdateRecord):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    admin: list[dict[str, list[str]]] = [{"bearer": []}]
    obj = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "RolloutPool updater",
            "version": "1",
            "description": "Push checkpoints; follow rolling updates.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/v1/updates": {
                "post": {
                    "operationId": "push_update",
                    "security": admin,
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("UpdateRequest")}},
                    },
                    "responses": {
                        "202": _json(_ref("UpdateRecord"), "queued"),
                        **_errors(400, 401, 403, 409, 422, 503),
                    },
                },
                "get": {
                    "operationId": "list_updates",
                    "security": admin,
                    "parameters": [
                        {
                            "name": "limit",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                        }
                    ],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "updates": {"type": "array", "items": _ref("UpdateRecord")}
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
                    "security": admin,
                    "parameters": [
                        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": _json(_ref("UpdateRecord"), "the update"),
                        **_errors(401, 403, 404, 503),
                    },
                }
            },
            "/v1/pool": {
                "get": {
                    "operationId": "pool",
                    "responses": {
                        "200": _json(obj, "replicas and the published generation"),
                        **_errors(503),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "responses": {"200": _json(obj, "serving"), **_errors(503)},
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {"operationId": "openapi", "responses": {"200": _json(obj, "this document")}}
            },
        },
    }
