"""The router's HTTP surface with a real Redis and no vLLM: auth, the admin boundary, unknown and
control routes, body validation, health, metrics, rate limiting, and that no secret leaks."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from pool.settings import StoreSettings
from pool.store import RedisStore
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client
from testkit.redis_server import RedisServer
from tests.helpers import refused_port

KEY = "sk-client-SECRET-1111"
ADMIN = "adm-SECRET-2222"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
COMPLETION = {"model": "rolloutpool", "prompt": "hi", "max_tokens": 1}

CONTROL_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/pause?mode=abort"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/collective_rpc"),
    ("POST", "/update_weights"),
    ("POST", "/start_weight_update"),
    ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/abort_requests"),
    ("POST", "/inference/v1/abort_requests"),
    ("GET", "/health"),
    ("GET", "/v1/../pause"),
    ("POST", "/v1/completions/render"),
]


def settings(**kw: Any) -> RouterSettings:
    base: dict[str, Any] = {"api_keys": [KEY], "admin_token": ADMIN, "admission_wait_s": 0.2}
    base.update(kw)
    return RouterSettings(**base)


async def test_client_routes_need_a_valid_api_key(store_settings: StoreSettings) -> None:
    async with router_client(settings(), store_settings) as c:
        r = await c.post("/v1/completions", json=COMPLETION)
        assert r.status == 401
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert (await r.json())["error"]["code"] == "unauthorized"
        r = await c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer x"})
        assert r.status == 401
        r = await c.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert r.status == 401
        # a valid key gets through auth (and then finds no replica: 503, not 401)
        r = await c.post("/v1/completions", json=COMPLETION, headers=AUTH)
        assert r.status == 503, await r.text()
        # the admin token works on client routes too
        r = await c.get("/v1/models", headers=ADMIN_AUTH)
        assert r.status == 200


async def test_admin_routes_refuse_client_keys(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", "http://127.0.0.1:1")])
    path = "/v1/admin/replicas/r0/taint"
    async with router_client(settings(), store_settings) as c:
        r = await c.post(path, json={"reason": "x"})
        assert r.status == 401
        r = await c.post(path, json={"reason": "x"}, headers=AUTH)
        assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden"
        assert (await store.replica("r0")).state == "READY"
        r = await c.post("/v1/admin/replicas/ghost/taint", json={"reason": "x"}, headers=ADMIN_AUTH)
        assert r.status == 404
        r = await c.post(path, json={"reason": ""}, headers=ADMIN_AUTH)
        assert r.status == 400
        r = await c.post(path, json={"reason": "operator says so"}, headers=ADMIN_AUTH)
        assert r.status == 200, await r.text()
        assert (await r.json())["previous_state"] == "READY"
        rec = await store.replica("r0")
        assert rec.state == "TAINTED" and "operator says so" in rec.reason
    async with router_client(settings(admin_token=None), store_settings) as c:
        r = await c.post(path, json={"reason": "x"}, headers=AUTH)
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"


async def test_no_keys_configured_means_open_data_plane(
    store_settings: StoreSettings, caplog: pytest.LogCaptureFixture
) -> None:
    async with router_client(settings(), store_settings):
        pass
    assert "anonymous mode" not in caplog.text
    async with router_client(settings(api_keys=[]), store_settings) as c:
        r = await c.get("/v1/models")
        assert r.status == 200
        assert (await r.json())["data"][0]["id"] == "rolloutpool"
    # Anonymous mode started without a word
    (warning,) = [r for r in caplog.records if "anonymous mode" in r.getMessage()]
    assert warning.levelno == logging.WARNING


@pytest.mark.parametrize("method,path", CONTROL_ROUTES)
async def test_vllm_control_routes_do_not_exist(
    store_settings: StoreSettings, method: str, path: str
) -> None:
    async with router_client(settings(), store_settings) as c:
        r = await c.request(method, path, json={}, headers=AUTH)
        assert r.status == 404, (path, r.status)
        body = await r.json()
        assert body["error"]["code"] == "not_found"


async def test_wrong_method_is_405_json(store_settings: StoreSettings) -> None:
    async with router_client(settings(), store_settings) as c:
        r = await c.get("/v1/completions", headers=AUTH)
        assert r.status == 405
        assert r.headers["Allow"] == "POST"
        body = await r.json()
        assert body["error"]["code"] == "method_not_allowed"
        r = await c.delete("/v1/rollouts/ro-x", headers=AUTH)
        assert r.status == 405


async def test_bad_bodies_are_400_and_oversized_413(store_settings: StoreSettings) -> None:
    async with router_client(settings(max_body_bytes=1024), store_settings) as c:
        for data, code in [
            (b"{not json", "invalid_json"),
            (b"", "invalid_json"),
            (b"[1, 2]", "invalid_body"),
            (b'"a string"', "invalid_body"),
            (b"\xff\xfe", "invalid_json"),
        ]:
            r = await c.post("/v1/completions", data=data, headers=AUTH)
            assert r.status == 400, data
            assert (await r.json())["error"]["code"] == code
        big = b'{"prompt": "' + b"x" * 2048 + b'"}'
        r = await c.post("/v1/chat/completions", data=big, headers=AUTH)
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "payload_too_large"

        async def chunked() -> Any:  # no Content-Length: the limit applies while reading
            for _ in range(4):
                yield b"x" * 600

        r = await c.post("/inference/v1/generate", data=chunked(), headers=AUTH)
        assert r.status == 413
        assert (await r.json())["error"]["code"] == "payload_too_large"
        r = await c.post(
            "/v1/completions",
            json={**COMPLETION, "rollout": {"generation": "soon"}},
            headers=AUTH,
        )
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_constraints"
        r = await c.post(
            "/v1/completions", json=COMPLETION, headers={**AUTH, "X-Rollout-Min-Generation": "-1"}
        )
        assert r.status == 400
        r = await c.post("/v1/rollouts", json={"generation": False}, headers=AUTH)
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_constraints"
        r = await c.post(
            "/v1/completions",
            json={**COMPLETION, "rollout": {"generation": 1}},
            headers={**AUTH, "X-Rollout-Generation": "0"},
        )
        assert r.status == 409 and (await r.json())["error"]["code"] == "generation_unsatisfiable"


async def test_fields_the_router_acts_on_are_typed(store_settings: StoreSettings) -> None:
    """Audit finding: ``"stream": "true"`` was forwarded, vLLM streamed, and the
    router buffered the stream as one body (no cap) and then answered 502."""
    async with router_client(settings(), store_settings) as c:
        for field, value in [
            ("stream", "true"),
            ("stream", 1),
            ("stream_options", "usage"),
            ("stream_options", [1]),
        ]:
            r = await c.post("/v1/completions", json={**COMPLETION, field: value}, headers=AUTH)
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_body", (field, value)
            assert field in err["message"]


async def test_unknown_model_is_404(store_settings: StoreSettings) -> None:
    async with router_client(settings(), store_settings) as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"}, headers=AUTH)
        assert r.status == 404
        body = await r.json()
        assert body["error"]["code"] == "model_not_found"
        assert "rolloutpool" in body["error"]["message"]


async def test_healthz_follows_redis_and_admission_fails_closed(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    try:
        ss = StoreSettings(url=redis.url, namespace="health", socket_timeout_s=0.5)
        async with router_client(settings(), ss) as c:
            r = await c.get("/healthz")
            assert r.status == 200 and (await r.json())["status"] == "ok"
            redis.stop()
            t0 = time.monotonic()
            r = await c.get("/healthz")
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "store_unavailable"
            r = await c.post("/v1/completions", json=COMPLETION, headers=AUTH)
            assert r.status == 503
            assert r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "store_unavailable"
            r = await c.post("/v1/rollouts", headers=AUTH)
            assert r.status == 503
            r = await c.get("/metrics")  # still scrapes, with stale pool gauges
            assert r.status == 200
            assert time.monotonic() - t0 < 5
    finally:
        redis.stop()


async def test_unreachable_store_never_hangs() -> None:
    ss = StoreSettings(url=f"redis://127.0.0.1:{refused_port()}/0", socket_timeout_s=0.5)
    async with router_client(settings(), ss) as c:
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json=COMPLETION, headers=AUTH)
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "store_unavailable"
        r = await c.get("/v1/pool", headers=AUTH)
        assert r.status == 503
        assert time.monotonic() - t0 < 5


async def test_pool_view(store_settings: StoreSettings, store: RedisStore) -> None:
    await publish_ready(store, [("r0", "http://127.0.0.1:1"), ("r1", "http://127.0.0.1:2")])
    async with router_client(settings(max_staleness=2), store_settings) as c:
        r = await c.get("/v1/pool", headers=AUTH)
        assert r.status == 200
        body = await r.json()
        assert body["latest"]["generation"] == 0 and body["latest"]["label"] == "g0"
        assert body["max_staleness"] == 2
        assert [
            (x["replica_id"], x["state"], x["generation"], x["label"], x["active"])
            for x in body["replicas"]
        ] == [("r0", "READY", 0, "g0", 0), ("r1", "READY", 0, "g0", 0)]
        # Replica URLs (dev-mode vLLM, unauthenticated control
        # routes) were shown to every client; only the admin token sees them now
        assert [x["url"] for x in body["replicas"]] == [None, None]
        r = await c.get("/v1/pool", headers=ADMIN_AUTH)
        urls = [x["url"] for x in (await r.json())["replicas"]]
        assert urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


async def test_upstream_failures_do_not_show_replica_urls(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """A 502 carried the replica's URL (aiohttp's error text)."""
    await publish_ready(store, [("r0", "http://127.0.0.1:1")])
    async with router_client(settings(), store_settings) as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers=AUTH)
        text = await r.text()
    assert r.status == 502 and (await r.json())["error"]["replica"] == "r0"
    assert "127.0.0.1" not in text and ":1" not in text.replace('"r0"', "")


async def test_dashboard_is_public_html(store_settings: StoreSettings, store: RedisStore) -> None:
    await publish_ready(store, [("r<0>", "http://10.0.0.7:8001")])
    await store.taint("r<0>", "<script>x</script>", source="test")
    async with router_client(settings(), store_settings) as c:
        r = await c.get("/dashboard")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        page = await r.text()
    assert "r&lt;0&gt;" in page and "TAINTED" in page and "&lt;script&gt;" in page
    # the reason is escaped in the HTML and in the JSON embedded for the page's script
    assert "<script>x" not in page and "x</script>" not in page and "10.0.0.7" not in page
    assert "\\u003cscript\\u003ex" in page


async def test_dashboard_data_is_public_json(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """``/dashboard/data`` (what the page polls): public, no replica URL, the pool-wide
    admission count and the replicas in the documented shape."""
    await publish_ready(store, [("r0", "http://10.0.0.7:8001"), ("r1", "http://10.0.0.8:8001")])
    await store.admit("ro-1", "r0")
    async with router_client(settings(), store_settings) as c:
        r = await c.get("/dashboard/data")
        assert r.status == 200
        data = await r.json()
    assert "10.0.0." not in json.dumps(data)
    assert data["admitted_total"] == 1 and data["latest"]["generation"] == 0
    assert [(x["id"], x["state"], x["active"]) for x in data["replicas"]] == [
        ("r0", "READY", 1),
        ("r1", "READY", 0),
    ]


async def test_metrics_exposition_has_no_secrets(
    store_settings: StoreSettings, store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await publish_ready(store, [("r0", "http://127.0.0.1:1")])
    async with router_client(settings(upstream_api_key="up-SECRET-3333"), store_settings) as c:
        await c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer bad"})
        await c.post("/v1/completions", json=COMPLETION, headers=AUTH)  # upstream unreachable
        await c.post(
            "/v1/completions", json=COMPLETION, headers={**AUTH, "X-Rollout-Generation": "7"}
        )
        await c.post("/v1/admin/replicas/r0/taint", json={"reason": "t"}, headers=AUTH)
        r = await c.get("/metrics")  # public: no key needed
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in [
        "rolloutpool_admissions_total",
        "rolloutpool_admission_refusals_total",
        "rolloutpool_rollouts_ended_total",
        "rolloutpool_request_seconds_bucket",
        "rolloutpool_admission_seconds_bucket",
        'rolloutpool_replica_state{replica="r0",state="READY"} 1.0',
        'rolloutpool_replica_generation{replica="r0"} 0.0',
        'rolloutpool_active_bindings{replica="r0"} 0.0',
        "rolloutpool_published_generation 0.0",
        'rolloutpool_admission_refusals_total{reason="generation_unsatisfiable"} 1.0',
        'rolloutpool_rollouts_ended_total{state="aborted"} 1.0',
        'route="/v1/completions"',
    ]:
        assert name in text, name
    for secret in (KEY, ADMIN, "up-SECRET-3333", "SECRET"):
        assert secret not in text
        assert secret not in caplog.text
    assert repr(settings()).count("SECRET") == 0


async def test_rate_limit_answers_429(store_settings: StoreSettings) -> None:
    async with router_client(
        settings(rate_limit_per_s=0.5, rate_limit_burst=2), store_settings
    ) as c:
        codes = [(await c.get("/v1/models", headers=AUTH)).status for _ in range(3)]
        assert codes == [200, 200, 429]
        r = await c.get("/v1/models", headers=AUTH)
        assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "rate_limited"
        assert (await c.get("/healthz")).status == 200  # public routes are not limited
        assert (await c.get("/v1/models", headers=ADMIN_AUTH)).status == 200


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTPOOL_ROUTER_API_KEYS", "a, b")
    monkeypatch.setenv("ROLLOUTPOOL_ROUTER_MAX_STALENESS", "2")
    s = RouterSettings()
    assert [k.get_secret_value() for k in s.api_keys] == ["a", "b"] and s.max_staleness == 2
    monkeypatch.setenv("ROLLOUTPOOL_ROUTER_API_KEYS", '["x"]')
    assert [k.get_secret_value() for k in RouterSettings().api_keys] == ["x"]
    with pytest.raises(ValueError):
        RouterSettings(api_keys=["same"], admin_token="same")


async def test_concurrent_requests_with_no_replica_all_get_503(
    store_settings: StoreSettings,
) -> None:
    async with router_client(settings(admission_wait_s=0.3), store_settings) as c:
        t0 = time.monotonic()
        rs = await asyncio.gather(
            *(c.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(10))
        )
        assert [r.status for r in rs] == [503] * 10
        assert time.monotonic() - t0 < 3


async def test_reasons_name_no_url_or_path_outside_the_admin(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """Audit finding: a taint reason (a transfer's error) carried the replica's URL and the
    checkpoint's path onto the public ``/dashboard/data`` and the client's ``/v1/pool``."""
    await publish_ready(store, [("r0", "http://10.0.0.7:8001")])
    why = "transfer: reload_weights(/ckpt/step-7) on http://10.0.0.7:8001 reported [1]"
    await store.taint("r0", why, source="test")
    async with router_client(settings(), store_settings) as c:
        data = await (await c.get("/dashboard/data")).json()
        client = await (await c.get("/v1/pool", headers=AUTH)).json()
        admin = await (await c.get("/v1/pool", headers=ADMIN_AUTH)).json()
    public = "transfer: reload_weights(<path>) on <url> reported [1]"
    assert data["replicas"][0]["reason"] == public
    assert client["replicas"][0]["reason"] == public
    assert admin["replicas"][0]["reason"] == why
