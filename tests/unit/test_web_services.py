"""The router and the updater answer alike (both on the HTTP kit, pool.web): the same status and
code for the same error, the same auth answers, the same ``/v1/pool``. Real Redis; the
updater's API runs around an updater that is not started (no vLLM needed for these routes)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from safetensors.numpy import save_file

from pool.settings import StoreSettings
from pool.store import RedisStore
from router.app import create_app as create_router
from router.settings import RouterSettings
from testkit.harness import publish_ready
from tests.helpers import refused_port
from updater.app import create_api
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

ADMIN = "adm-token"
Client = TestClient[web.Request, web.Application]
Service = Callable[[StoreSettings, str | None], AbstractAsyncContextManager[Client]]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    return tmp_path


@asynccontextmanager
async def router(store_settings: StoreSettings, admin: str | None) -> AsyncIterator[Client]:
    settings = RouterSettings(admin_token=admin, max_staleness=1, admission_wait_s=0.1)
    async with TestClient(TestServer(create_router(settings, store_settings))) as c:
        yield c


def updater_service(model: Path) -> Service:
    @asynccontextmanager
    async def updater(store_settings: StoreSettings, admin: str | None) -> AsyncIterator[Client]:
        settings = UpdaterSettings(
            admin_token=admin,
            max_staleness=1,
            replicas=[
                ReplicaConfig(id="r0", url=f"http://127.0.0.1:{refused_port()}", model=model)
            ],
        )
        store = RedisStore.connect(store_settings)
        try:
            app = create_api(Updater(settings, store), settings)
            async with TestClient(TestServer(app)) as c:
                yield c
        finally:
            await store.close()

    return updater


@dataclass
class Svc:
    open: Service
    admin_route: tuple[str, str]
    body_route: str


@pytest.fixture(params=["router", "updater"])
def service(request: pytest.FixtureRequest, model_dir: Path) -> Svc:
    if request.param == "router":
        return Svc(router, ("POST", "/v1/admin/replicas/r0/taint"), "/v1/rollouts")
    return Svc(updater_service(model_dir), ("GET", "/v1/updates"), "/v1/updates")


async def test_admin_auth_answers_alike(store_settings: StoreSettings, service: Svc) -> None:
    method, path = service.admin_route
    async with service.open(store_settings, ADMIN) as c:
        r = await c.request(method, path, json={"reason": "x"})
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert (await r.json())["error"]["code"] == "unauthorized"
        r = await c.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"
    async with service.open(store_settings, None) as c:
        r = await c.request(method, path, json={"reason": "x"})
        assert r.status == 401  # no header: 401 first, whether or not admin is enabled
        r = await c.request(method, path, headers={"Authorization": "Bearer any"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"


async def test_http_errors_answer_alike(store_settings: StoreSettings, service: Svc) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with service.open(store_settings, ADMIN) as c:
        r = await c.get("/no/such/route", headers=auth)
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        for method, path in [("TRACE", "/healthz"), ("DELETE", "/v1/pool"), ("PUT", "/metrics")]:
            r = await c.request(method, path, headers=auth)
            assert r.status == 405 and r.headers["Allow"] == "GET", (method, path)
            assert (await r.json())["error"]["code"] == "method_not_allowed"
        path = service.body_route
        for data, code in [(b"{nope", "invalid_json"), (b"[1]", "invalid_body")]:
            r = await c.post(path, data=data, headers=auth)
            assert r.status == 400 and (await r.json())["error"]["code"] == code
        r = await c.post(path, data=b"x" * (5 << 20), headers=auth)  # above both limits
        assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
        # A deeply nested body was a 500 with a traceback, and
        # NaN/Infinity (or a number beyond a double) were accepted and forwarded to vLLM
        for data, what in [
            (b"[" * 100_000 + b"]" * 100_000, "nested more than 64"),
            (b'{"a":' * 65 + b"1" + b"}" * 65, "nested more than 64"),
            (b'{"temperature": NaN}', "NaN is not a JSON number"),
            (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
            (b'{"temperature": 1e999}', "too large for a double"),
        ]:
            r = await c.post(path, data=data, headers=auth)
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_json", (data[:20], err)
            assert what in err["message"]


async def test_unreachable_store_answers_alike(service: Svc) -> None:
    ss = StoreSettings(url=f"redis://127.0.0.1:{refused_port()}/0", socket_timeout_s=0.5)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with service.open(ss, ADMIN) as c:
        r = await c.get("/v1/pool", headers=auth)
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "store_unavailable"
        r = await c.get("/healthz")
        body: dict[str, Any] = await r.json()
        assert r.status == 503 and body["status"] == "unavailable"
        assert body["error"]["code"] == "store_unavailable"


async def test_pool_view_is_one_shape(
    store_settings: StoreSettings, store: RedisStore, model_dir: Path
) -> None:
    await publish_ready(store, [("r0", "http://127.0.0.1:1"), ("r1", "http://127.0.0.1:2")])
    await store.taint("r1", "operator", source="test")
    auth = {"Authorization": f"Bearer {ADMIN}"}
    views, public = [], []
    for open_service in (router, updater_service(model_dir)):
        async with open_service(store_settings, ADMIN) as c:
            r = await c.get("/v1/pool", headers=auth)
            assert r.status == 200
            views.append(await r.json())
            for headers in ({}, {"Authorization": "Bearer not-the-admin"}):
                r = await c.get("/v1/pool", headers=headers)
                public.append(await r.json())
    assert views[0] == views[1]
    # Replica URLs only for the admin token, on both services
    assert [x["url"] for x in views[0]["replicas"]] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for other in public:
        assert [x["url"] for x in other["replicas"]] == [None, None]
        assert {**other, "replicas": []} == {**views[0], "replicas": []}
    view = views[0]
    assert view["latest"] == {"generation": 0, "label": "g0", "identity_digest": "wid:test"}
    assert view["max_staleness"] == 1
    assert [(x["replica_id"], x["state"], x["generation"]) for x in view["replicas"]] == [
        ("r0", "READY", 0),
        ("r1", "TAINTED", 0),
    ]
    assert set(view["replicas"][0]) == {
        "replica_id",
        "state",
        "generation",
        "label",
        "identity_digest",
        "active",
        "capacity",
        "url",
        "reason",
        "updated_ms",
    }


def sample(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


async def test_redis_memory_is_on_both_services_metrics(
    store_settings: StoreSettings, store: RedisStore, service: Svc
) -> None:
    """Issue 11: Redis filled up silently; both services' /metrics carry its memory (for the
    alerts in deploy/prometheus/alerts.yml) and whether it answered."""
    await store.r.config_set("maxmemory", str(3 << 30))
    try:
        async with service.open(store_settings, ADMIN) as c:
            text = await (await c.get("/metrics")).text()
    finally:
        await store.r.config_set("maxmemory", "0")
    assert sample(text, "rolloutpool_redis_up") == 1.0
    assert sample(text, "rolloutpool_redis_maxmemory_bytes") == 3 << 30
    used = sample(text, "rolloutpool_redis_used_memory_bytes")
    assert 0 < used < 3 << 30
    ss = StoreSettings(url=f"redis://127.0.0.1:{refused_port()}/0", socket_timeout_s=0.5)
    async with service.open(ss, ADMIN) as c:
        text = await (await c.get("/metrics")).text()
    assert sample(text, "rolloutpool_redis_up") == 0.0
