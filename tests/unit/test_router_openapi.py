"""The router's OpenAPI document matches its routes (the whole document against the running
service: schemathesis in tests/integration/test_api_conformance.py)."""

from __future__ import annotations

from pool.settings import StoreSettings
from router.app import create_app
from router.openapi import document
from router.settings import RouterSettings


def test_document_matches_routes() -> None:
    app = create_app(RouterSettings(), StoreSettings(url="redis://127.0.0.1:9/0"))
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    doc = document()
    assert routes == {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert doc["openapi"] == "3.1.0"
    for ops in doc["paths"].values():  # every operation answers something documented
        assert all(op["responses"] for op in ops.values())


def test_the_data_plane_security_follows_the_client_keys() -> None:
    # pins: with keys configured, a request without one is 401, so the document must not
    # promise anonymous access (and without keys it must not demand a token)
    for keys, security in [(True, [{"bearer": []}]), (False, [])]:
        doc = document(client_keys=keys)
        for path in ("/v1/completions", "/v1/rollouts", "/v1/pool"):
            assert next(iter(doc["paths"][path].values()))["security"] == security
        taint = doc["paths"]["/v1/admin/replicas/{replica_id}/taint"]["post"]
        assert taint["security"] == [{"bearer": []}]


def test_the_inference_bodies_require_what_vllm_requires() -> None:
    # pins: /inference/v1/generate without sampling_params is answered 400 by vLLM, so the
    # document must not call such a body valid (tests/integration/test_quickstart.py sends
    # each documented minimal body to vLLM itself)
    paths = document()["paths"]
    required = {
        path: paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"][
            "required"
        ]
        for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
    }
    assert required == {
        "/v1/completions": ["prompt"],  # vLLM takes the served model when none is named
        "/v1/chat/completions": ["messages"],
        "/inference/v1/generate": ["token_ids", "sampling_params"],
    }
    for path, fields in required.items():  # each example is a body the document calls valid
        example = paths[path]["post"]["requestBody"]["content"]["application/json"]["example"]
        assert set(fields) <= set(example), path
