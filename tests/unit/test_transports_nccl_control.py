"""``updater.transports.nccl.control``: the HTTP control client's routes, bodies and errors
(the server faked at the HTTP seam)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from updater.transports.nccl import HttpStepError, HttpWeightSyncClient


def test_http_sync_client_routes_and_errors() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        if request.url.path == "/finish_weight_update" and body:
            return httpx.Response(422, json={"detail": "bad"})
        if request.url.path == "/update_weights":
            return httpx.Response(500, json={"error": "boom"})
        return httpx.Response(200, json={"message": "ok"})

    c = HttpWeightSyncClient("http://x/", transport=httpx.MockTransport(handler))
    c.init_weight_transfer_engine({"master_port": 1})
    c.start_weight_update()
    c.finish_weight_update()
    with pytest.raises(HttpStepError) as e:
        c.update_weights({"names": []})
    assert e.value.status == 500 and not e.value.refused
    with pytest.raises(HttpStepError) as e:
        c.finish_weight_update("v1")
    assert e.value.refused
    assert seen == [
        ("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}),
        ("/start_weight_update", None),
        ("/finish_weight_update", None),
        ("/update_weights", {"update_info": {"names": []}}),
        ("/finish_weight_update", {"weight_version": "v1"}),
    ]

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    c = HttpWeightSyncClient("http://x", transport=httpx.MockTransport(refuse))
    with pytest.raises(HttpStepError) as e:
        c.start_weight_update()
    assert e.value.refused and not e.value.sent
