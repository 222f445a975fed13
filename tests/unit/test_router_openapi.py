"""The router's OpenAPI document matches its routes, and is a valid OpenAPI 3.1 document."""

from __future__ import annotations

import schemathesis

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
    schema = schemathesis.openapi.from_dict(doc)
    assert {op.ok().path for op in schema.get_all_operations()} == set(doc["paths"])
