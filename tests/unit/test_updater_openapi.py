"""The updater's OpenAPI document matches its routes and its rules (the whole document against
the running service: schemathesis in tests/integration/test_api_conformance.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from jsonschema import Draft202012Validator
from pydantic import ValidationError
from safetensors.numpy import save_file

from pool.settings import StoreSettings
from pool.store import RedisStore
from updater.app import create_api, create_app
from updater.openapi import document
from updater.service import Updater, UpdateRequest
from updater.settings import ReplicaConfig, UpdaterSettings


def model(tmp_path: Path) -> Path:
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_document_matches_routes(tmp_path: Path) -> None:
    settings = UpdaterSettings(
        replicas=[ReplicaConfig(id="r0", url="http://127.0.0.1:9", model=model(tmp_path))]
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


@pytest.mark.parametrize("path", ["/abs/ckpt", "/", "relative/ckpt", "./x", "", "~/x", "0"])
def test_the_declared_checkpoint_pattern_is_the_models_rule(path: str) -> None:
    # pins: a relative checkpoint was a 422 for a body the document called valid
    body = {"checkpoint": path, "probe": {"prompt_token_ids": [1], "expected_token_ids": [2]}}
    schema = {**document()["components"]["schemas"]["UpdateRequest"]}
    schema["components"] = document()["components"]
    declared = not list(Draft202012Validator(schema).iter_errors(body))
    try:
        UpdateRequest.model_validate(body, strict=True)
        accepted = True
    except ValidationError:
        accepted = False
    assert declared == accepted


async def test_list_limit_is_enforced(tmp_path: Path, store_settings: StoreSettings) -> None:
    # pins: ?limit=1001 was answered 200 (clamped) although the document says maximum 1000
    settings = UpdaterSettings(
        admin_token="t",
        replicas=[ReplicaConfig(id="r0", url="http://127.0.0.1:9", model=model(tmp_path))],
    )
    store = RedisStore.connect(store_settings)
    auth = {"Authorization": "Bearer t"}
    try:
        app = create_api(Updater(settings, store), settings)
        async with TestClient(TestServer(app)) as c:
            for limit, status in [("1", 200), ("1000", 200), ("1001", 400), ("0", 400), ("x", 400)]:
                r = await c.get(f"/v1/updates?limit={limit}", headers=auth)
                assert r.status == status, limit
                if status == 400:
                    assert (await r.json())["error"]["code"] == "invalid_query"
            r = await c.post(
                "/v1/updates",
                json={
                    "checkpoint": "/x",
                    "step": True,
                    "probe": {"prompt_token_ids": [1], "expected_token_ids": [2]},
                },
                headers=auth,
            )
            assert r.status == 422 and (await r.json())["error"]["code"] == "invalid_body"
    finally:
        await store.close()
