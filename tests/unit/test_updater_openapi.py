"""The updater's OpenAPI document matches its routes (its validity is exercised by the
schemathesis fuzz run in tests/integration/test_reliability.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pool.settings import StoreSettings
from updater.app import create_app
from updater.openapi import document
from updater.settings import ReplicaConfig, UpdaterSettings


def test_document_matches_routes(tmp_path: Path) -> None:
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    settings = UpdaterSettings(
        replicas=[ReplicaConfig(id="r0", url="http://127.0.0.1:9", model=tmp_path)]
    )
    app = create_app(settings, StoreSettings(url="redis://127.0.0.1:9/0"))
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    doc = document()
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    assert doc["openapi"] == "3.1.0"
    for ops in doc["paths"].values():  # every operation answers something documented
        assert all(op["responses"] for op in ops.values())
