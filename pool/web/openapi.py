"""Building blocks of both services' OpenAPI 3.1 documents.

Schemas come from the pydantic models the handlers validate with (:func:`model_schemas`), so a
document cannot drift from what a handler accepts or answers; the shared routes
(:mod:`pool.web.handlers`) are documented here once (:func:`common_paths`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from pool.web.handlers import PoolView

Schema = dict[str, Any]

#: ``{"error": {"code", "message", ...context}}`` (context fields vary by code).
ERROR: Schema = {
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

#: ``GET /healthz``: 200 with ``status: ok``; 503 with the reason in ``error``.
HEALTH: Schema = {
    "type": "object",
    "required": ["status"],
    "properties": {
        "status": {"type": "string", "enum": ["ok", "starting", "unavailable"]},
        "error": ERROR["properties"]["error"],
    },
}

#: Security requirements: a bearer token (the admin token, or a client key where the path is a
#: client path and keys are configured); none.
ADMIN: list[dict[str, list[str]]] = [{"bearer": []}]
PUBLIC: list[dict[str, list[str]]] = []


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_content(schema: Schema, description: str) -> Schema:
    """A response (or request body) object with one ``application/json`` schema."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def error_responses(texts: Mapping[int, str], *statuses: int) -> Schema:
    """``{"<status>": <Error response>}`` for each status, described by ``texts``."""
    return {str(s): json_content(ref("Error"), texts[s]) for s in statuses}


def model_schemas(*models: type[BaseModel]) -> dict[str, Schema]:
    """Component schemas of ``models`` and every model they refer to."""
    out: dict[str, Schema] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def common_paths(*, pool_security: list[dict[str, list[str]]], pool_errors: Schema) -> Schema:
    """``/healthz``, ``/metrics``, ``/v1/pool`` and ``/openapi.json`` (all GET)."""
    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}
    return {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "security": PUBLIC,
                "responses": {
                    "200": json_content(ref("Health"), "Redis reachable and ready"),
                    "503": json_content(ref("Health"), "Redis unreachable or not ready"),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "security": PUBLIC,
                "responses": {"200": {"description": "Prometheus text", **text}},
            }
        },
        "/v1/pool": {
            "get": {
                "operationId": "pool",
                "security": pool_security,
                "responses": {
                    "200": json_content(ref("PoolView"), "the published generation, replicas"),
                    **pool_errors,
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "security": PUBLIC,
                "responses": {"200": json_content({"type": "object"}, "this document")},
            }
        },
    }


def document(
    *, title: str, description: str, paths: Schema, schemas: Mapping[str, Schema]
) -> Schema:
    """The whole document: ``paths`` plus the shared schemas (Error, Health, PoolView)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1", "description": description},
        "components": {
            "schemas": {
                "Error": ERROR,
                "Health": HEALTH,
                **model_schemas(PoolView),
                **schemas,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": paths,
    }
