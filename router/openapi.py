"""The router's OpenAPI 3.1 document (served at ``/openapi.json``).

The inference routes take vLLM's OpenAI-compatible bodies (documented as open objects with the
fields the router itself reads and exactly the ones vLLM requires: ``prompt``, ``messages``,
``token_ids`` + ``sampling_params``; ``model`` is optional, the served model by default; the
replica validates the rest, and its 4xx answers are passed through as ``ReplicaError``); the
router's own bodies come from its pydantic models.
``tests/unit/test_router_openapi.py`` keeps the document in sync with the route table.
Documented server errors: 502 (upstream failed or a provenance violation), 503 (no admissible
replica, or Redis unreachable — admission fails closed), 504 (upstream timeout). A 500 is a bug.
"""

from __future__ import annotations

from typing import Any

from pool.web import openapi as kit
from pool.web.openapi import ADMIN, PUBLIC, error_responses, json_content, model_schemas, ref
from router.constraints import Constraints
from router.status import TaintRequest

_TEXT = {
    400: "bad JSON or body, or more sequences (n, best_of, a prompt array) than the request can "
    "be charged for (one_sequence_per_request, too_many_sequences)",
    401: "missing or wrong client key",
    403: "admin only",
    404: "unknown route, model or rollout",
    405: "method not allowed",
    409: "generation unsatisfiable (none admissible meets the constraints, or the headers and "
    "the body name different generations) or rollout not active",
    413: "body too large",
    422: "rejected by the replica",
    429: "rate limited, or a client limit reached (client_sessions, client_in_flight, "
    "session_busy); Retry-After says when to try again",
    502: "upstream error or provenance violation",
    503: "no admissible replica or store unavailable",
    504: "upstream timeout",
}
ROLLOUT = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "generation": {"type": "integer"},
        "label": {"type": "string"},
        "identity_digest": {"type": "string"},
        "replica": {"type": "string"},
        "adapter": {
            "type": "string",
            "description": "a pool whose generations are LoRA adapters: the one that generated it",
        },
    },
}
#: A replica's own 4xx answer, passed through with the ``rollout`` object added: vLLM's
#: ``ErrorResponse`` (``error.code`` is the HTTP status, an integer) or FastAPI's ``detail``.
REPLICA_ERROR = {
    "type": "object",
    "required": ["rollout"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
        },
        "detail": {},
        "rollout": ref("Rollout"),
    },
}
Security = list[dict[str, list[str]]]
ID = {"name": "rollout_id", "in": "path", "required": True, "schema": {"type": "string"}}


_INT_OR_NULL = {"type": ["integer", "null"]}
_NUM_OR_NULL = {"type": ["number", "null"]}
DASHBOARD_DATA = {
    "type": "object",
    "required": ["now_ms", "latest", "max_staleness", "replicas", "admitted_total", "updates"],
    "properties": {
        "now_ms": {"type": "integer"},
        "latest": {
            "type": ["object", "null"],
            "properties": {"generation": {"type": "integer"}, "label": {"type": "string"}},
        },
        "max_staleness": {"type": "integer"},
        "replicas": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "state", "generation", "active", "capacity", "reason"],
                "properties": {
                    "id": {"type": "string"},
                    "state": {"type": "string"},
                    "generation": _INT_OR_NULL,
                    "active": {"type": "integer"},
                    "capacity": {"type": "integer"},
                    "reason": {"type": "string"},
                    "adapter": {
                        "type": ["string", "null"],
                        "description": "a LoRA pool: the adapter it admits new rollouts on "
                        "(null: the base model, generation 0)",
                    },
                    "adapters": {
                        "type": ["array", "null"],
                        "items": {"type": "string"},
                        "description": "a LoRA pool: every adapter something on it still runs "
                        "on ('base' for generation 0; null: a grant's generation is unknown)",
                    },
                },
            },
        },
        "admitted_total": {"type": "integer"},
        "admissions": {"type": "object", "additionalProperties": {"type": "integer"}},
        "updates": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "generation", "state"],
                "properties": {
                    "id": {"type": "string"},
                    "generation": {"type": "integer"},
                    "label": {"type": "string"},
                    "state": {"type": "string"},
                    "created_ms": {"type": "integer"},
                    "started_ms": _INT_OR_NULL,
                    "published_ms": _INT_OR_NULL,
                    "rolled_ms": _INT_OR_NULL,
                    "finished_ms": _INT_OR_NULL,
                    "staleness_window_s": _NUM_OR_NULL,
                    "replicas_updated": {"type": "integer"},
                    "window_s_median": _NUM_OR_NULL,
                    "window_s_max": _NUM_OR_NULL,
                },
            },
        },
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_responses(_TEXT, *codes)


#: Fields vLLM requires (or reads with a type) beyond the router's own, per route.
MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["role"],
        "properties": {"role": {"type": "string"}, "content": {}},
    },
}
TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
SAMPLING_PARAMS = {
    "type": "object",
    "description": "vLLM's SamplingParams (max_tokens, temperature, ...); required by vLLM; "
    "`n` and `best_of` are read as for /v1/completions",
    "additionalProperties": True,
}
#: What the router reads to count a request's sequences (router.limits.sequences): each is
#: one slot of its replica under a grant; a session's request may ask for one only.
SEQUENCES = {
    "n": {
        "type": "integer",
        "minimum": 1,
        "description": "sequences per prompt (default 1); more than one is charged one slot "
        "each, and refused (400 one_sequence_per_request) on a session's request or with "
        "grants off",
    },
    "best_of": {
        "type": "integer",
        "minimum": 1,
        "description": "sequences generated per prompt when larger than `n`; charged as `n`",
    },
}
PROMPT = {
    "description": "a string or a token-id list (one prompt), or an array of either: that "
    "many prompts, charged as `n` each"
}


def _inference(
    op: str,
    required: list[str],
    example: dict[str, Any],
    client: Security,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = {
        "type": "object",
        "required": required,
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string"},
            "stream": {"type": "boolean"},
            "rollout": ref("Constraints"),
            **(fields or {}),
        },
    }
    either = {"anyOf": [ref("Error"), ref("ReplicaError")]}
    return {
        "post": {
            "operationId": op,
            "security": client,
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
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": body, "example": example}},
            },
            "responses": {
                "200": {
                    "description": "vLLM's response plus a `rollout` object (JSON) or SSE",
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "properties": {"rollout": ref("Rollout")}}
                        },
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                # the router's own 4xx, or the replica's (it validates the rest of the body)
                **{
                    str(s): json_content(either, _TEXT[s] + "; or the replica's 4xx, passed on")
                    for s in (400, 404, 422)
                },
                "4XX": json_content(either, "the replica's 4xx, passed through"),
                **_errors(401, 409, 413, 429, 502, 503, 504),
            },
        }
    }


def document(*, client_keys: bool = False, model: str = "rolloutpool") -> dict[str, Any]:
    """The document of a router with (``client_keys``) or without client API keys configured:
    the data plane's security is a bearer token (a client key or the admin token) or none.
    ``model`` (the served model name) is used in the request examples."""
    client: Security = ADMIN if client_keys else PUBLIC
    short = {"max_tokens": 4, "temperature": 0.0}
    obj = {"type": "object"}
    html = {"content": {"text/html": {"schema": {"type": "string"}}}}
    paths: dict[str, Any] = {
        "/v1/completions": _inference(
            "completions",
            ["prompt"],
            {"model": model, "prompt": "Once upon a time", **short},
            client,
            {"prompt": PROMPT, **SEQUENCES},
        ),
        "/v1/chat/completions": _inference(
            "chat_completions",
            ["messages"],
            {"model": model, "messages": [{"role": "user", "content": "Hello"}], **short},
            client,
            {"messages": MESSAGES, **SEQUENCES},
        ),
        "/inference/v1/generate": _inference(
            "generate",
            ["token_ids", "sampling_params"],
            {"token_ids": [1, 2, 3, 4], "sampling_params": short},
            client,
            {"token_ids": TOKEN_IDS, "sampling_params": SAMPLING_PARAMS},
        ),
        "/v1/models": {
            "get": {
                "operationId": "models",
                "security": client,
                "responses": {"200": json_content(obj, "the served model"), **_errors(401)},
            }
        },
        "/v1/rollouts": {
            "post": {
                "operationId": "open_session",
                "security": client,
                "requestBody": {
                    "required": False,
                    "content": {"application/json": {"schema": ref("Constraints")}},
                },
                "responses": {
                    "201": json_content(obj, "the session binding"),
                    **_errors(400, 401, 409, 413, 429, 503),
                },
            }
        },
        "/v1/rollouts/{rollout_id}": {
            "get": {
                "operationId": "get_rollout",
                "security": client,
                "parameters": [ID],
                "responses": {
                    "200": json_content(obj, "the provenance record"),
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
                    "200": json_content(obj, "lease extended"),
                    **_errors(401, 404, 409, 503),
                },
            }
        },
        "/v1/rollouts/{rollout_id}/close": {
            "post": {
                "operationId": "close_session",
                "security": client,
                "parameters": [ID],
                "responses": {"200": json_content(obj, "closed"), **_errors(401, 404, 409, 503)},
            }
        },
        "/dashboard": {
            "get": {
                "operationId": "dashboard",
                "responses": {
                    "200": {"description": "live HTML page", **html},
                    "503": {"description": "store unavailable", **html},
                },
            }
        },
        "/dashboard/data": {
            "get": {
                "operationId": "dashboard_data",
                "description": "the pool now, as the dashboard's script polls it (public)",
                "responses": {
                    "200": json_content(ref("DashboardData"), "replicas, updates, admissions"),
                    **_errors(503),
                },
            }
        },
        "/v1/admin/replicas/{replica_id}/taint": {
            "post": {
                "operationId": "taint",
                "security": ADMIN,
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
                    "content": {"application/json": {"schema": ref("TaintRequest")}},
                },
                "responses": {
                    "200": json_content(obj, "tainted"),
                    **_errors(400, 401, 403, 404, 413, 503),
                },
            }
        },
        **kit.common_paths(pool_security=client, pool_errors=_errors(401, 503)),
    }
    return kit.document(
        title="RolloutPool router",
        description="OpenAI-compatible rollouts bound to one policy generation.",
        paths=paths,
        schemas={
            "Rollout": ROLLOUT,
            "ReplicaError": REPLICA_ERROR,
            "DashboardData": DASHBOARD_DATA,
            **model_schemas(Constraints, TaintRequest),
        },
    )
