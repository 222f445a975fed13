"""The router's OpenAPI 3.1 document (served at ``/openapi.json``).

The inference routes take vLLM's OpenAI-compatible bodies (documented as open objects with the
fields the router itself reads); the router's own bodies come from its pydantic models.
``tests/unit/test_router_openapi.py`` keeps the document in sync with the route table.
Documented server errors: 502 (upstream failed or a provenance violation), 503 (no admissible
replica, or Redis unreachable — admission fails closed), 504 (upstream timeout). A 500 is a bug.
"""

from __future__ import annotations

from typing import Any

from router.admission import Constraints
from router.status import TaintRequest

_TEXT = {
    400: "bad JSON or body",
    401: "missing or wrong client key",
    403: "admin only",
    422: "rejected by the replica (its 4xx is passed through)",
    404: "unknown route, model or rollout",
    405: "method not allowed",
    409: "generation unsatisfiable or rollout not active",
    413: "body too large",
    429: "rate limited",
    502: "upstream error or provenance violation",
    503: "no admissible replica or store unavailable",
    504: "upstream timeout",
}
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
ROLLOUT = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "generation": {"type": "integer"},
        "label": {"type": "string"},
        "identity_digest": {"type": "string"},
        "replica": {"type": "string"},
    },
}
ID = {"name": "rollout_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _json(_ref("Error"), _TEXT[c]) for c in codes}


def _inference(op: str, required: list[str]) -> dict[str, Any]:
    body = {
        "type": "object",
        "required": required,
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string"},
            "stream": {"type": "boolean"},
            "rollout": _ref("Constraints"),
        },
    }
    return {
        "post": {
            "operationId": op,
            "security": [{}, {"bearer": []}],
            "parameters": [
                {
                    "name": "X-Rollout-Id",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                },
                {
                    "name": "X-Rollout-Min-Generation",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 0},
                },
                {
                    "name": "X-Rollout-Generation",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 0},
                },
            ],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "vLLM's response plus a `rollout` object (JSON) or SSE",
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "properties": {"rollout": _ref("Rollout")}}
                        },
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                # the replica's own 4xx answers (e.g. 403, 422) are passed through unchanged
                "4XX": _json(
                    _ref("Error"), "client error (the router's, or the replica's passed through)"
                ),
                **_errors(400, 401, 404, 409, 413, 429, 502, 503, 504),
            },
        }
    }


def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR, "Rollout": ROLLOUT}
    for model in (Constraints, TaintRequest):
        schemas[model.__name__] = model.model_json_schema(
            ref_template="#/components/schemas/{model}"
        )
    obj = {"type": "object"}
    client: list[dict[str, list[str]]] = [{}, {"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "RolloutPool router",
            "version": "1",
            "description": "OpenAI-compatible rollouts bound to one policy generation.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": {
            "/v1/completions": _inference("completions", ["model", "prompt"]),
            "/v1/chat/completions": _inference("chat_completions", ["model", "messages"]),
            "/inference/v1/generate": _inference("generate", ["token_ids"]),
            "/v1/models": {
                "get": {
                    "operationId": "models",
                    "security": client,
                    "responses": {"200": _json(obj, "the served model"), **_errors(401)},
                }
            },
            "/v1/rollouts": {
                "post": {
                    "operationId": "open_session",
                    "security": client,
                    "requestBody": {
                        "required": False,
                        "content": {"application/json": {"schema": _ref("Constraints")}},
                    },
                    "responses": {
                        "201": _json(obj, "the session binding"),
                        **_errors(400, 401, 409, 413, 503),
                    },
                }
            },
            "/v1/rollouts/{rollout_id}": {
                "get": {
                    "operationId": "get_rollout",
                    "security": client,
                    "parameters": [ID],
                    "responses": {
                        "200": _json(obj, "the provenance record"),
                        **_errors(401, 404, 503),
                    },
                }
            },
            "/v1/rollouts/{rollout_id}/heartbeat": {
                "post": {
                    "operationId": "heartbeat",
                    "security": client,
                    "parameters": [ID],
                    "responses": {
                        "200": _json(obj, "lease extended"),
                        **_errors(401, 404, 409, 503),
                    },
                }
            },
            "/v1/rollouts/{rollout_id}/close": {
                "post": {
                    "operationId": "close_session",
                    "security": client,
                    "parameters": [ID],
                    "responses": {"200": _json(obj, "closed"), **_errors(401, 404, 409, 503)},
                }
            },
            "/v1/pool": {
                "get": {
                    "operationId": "pool",
                    "security": client,
                    "responses": {
                        "200": _json(obj, "replicas and the published generation"),
                        **_errors(401, 503),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "responses": {"200": _json(obj, "Redis reachable"), **_errors(503)},
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
            "/dashboard": {
                "get": {
                    "operationId": "dashboard",
                    "security": client,
                    "responses": {
                        "200": {
                            "description": "live HTML page",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        },
                        **_errors(401),
                    },
                }
            },
            "/v1/admin/replicas/{replica_id}/taint": {
                "post": {
                    "operationId": "taint",
                    "security": [{"bearer": []}],
                    "parameters": [
                        {
                            "name": "replica_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("TaintRequest")}},
                    },
                    "responses": {
                        "200": _json(obj, "tainted"),
                        **_errors(400, 401, 403, 404, 413, 503),
                    },
                }
            },
            "/openapi.json": {
                "get": {"operationId": "openapi", "responses": {"200": _json(obj, "this document")}}
            },
        },
    }
