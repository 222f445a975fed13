"""The HTTP kit (pool.web) on a small app of its own: the status table, the error middleware's
answers (JSON bodies, ``Allow`` on 405, ``Retry-After`` on 503, no internals in a 500) and the
auth rules. ``test_web_services.py`` checks that the router and the updater answer alike."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, SecretStr, ValidationError

from pool.errors import (
    AdmissionRefused,
    AmbiguousMutation,
    DeadlineExceeded,
    IllegalTransition,
    NotFound,
    PreflightFailed,
    RolloutPoolError,
    StaleFencingToken,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)
from pool.web import (
    CLIENT,
    AuthPolicy,
    BadRequest,
    Conflict,
    Unprocessable,
    auth_middleware,
    error_middleware,
    json_response,
    read_json_object,
    validate_strictly,
)

log = logging.getLogger("test-web")

TABLE: list[tuple[RolloutPoolError, int, str]] = [
    (StoreUnavailable("redis down"), 503, "store_unavailable"),
    (AdmissionRefused("not_ready"), 503, "admission_refused"),
    (NotFound("no such replica"), 404, "not_found"),
    (StoreConflict("cas lost"), 409, "store_conflict"),
    (StaleFencingToken("stale"), 409, "stale_fencing_token"),
    (IllegalTransition("no"), 409, "illegal_transition"),
    (PreflightFailed("bad checkpoint", diff=["w: shape"]), 422, "preflight_failed"),
    (StoreError("redis error reply"), 503, "store_error"),
    (AmbiguousMutation("half done"), 500, "ambiguous_mutation"),
    (DeadlineExceeded("late"), 500, "deadline_exceeded"),
    (RolloutPoolError("plain"), 500, "rolloutpool_error"),
    (BadRequest("x", code="invalid_json"), 400, "invalid_json"),
    (Conflict("x", code="generation_unsatisfiable", latest=3), 409, "generation_unsatisfiable"),
    (Unprocessable("x", code="invalid_body"), 422, "invalid_body"),
]


def app_raising(errors: dict[str, BaseException]) -> web.Application:
    """GET /raise/{name} raises ``errors[name]``; /secret/x is admin; /ok and /open are not."""

    async def raising(request: web.Request) -> web.Response:
        raise errors[request.match_info["name"]]

    async def ok(request: web.Request) -> web.Response:
        return json_response({"client": request.get(CLIENT)})

    async def echo(request: web.Request) -> web.Response:
        return json_response(await read_json_object(request, 64))

    policy = AuthPolicy(
        public=frozenset({"/open"}),
        admin_prefixes=("/secret/",),
        admin_token=SecretStr("adm"),
        api_keys=[SecretStr("k0"), SecretStr("k1")],
    )
    app = web.Application(
        middlewares=[error_middleware(log, retry_after_s=7), auth_middleware(policy)]
    )
    app.router.add_get("/raise/{name}", raising, allow_head=False)
    app.router.add_get("/ok", ok, allow_head=False)
    app.router.add_get("/open", ok, allow_head=False)
    app.router.add_get("/secret/x", ok, allow_head=False)
    app.router.add_post("/echo", echo)
    return app


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    errors: dict[str, BaseException] = {str(i): e for i, (e, _, _) in enumerate(TABLE)}
    errors["bug"] = KeyError("internal-detail-xyz")
    async with TestClient(TestServer(app_raising(errors))) as c:
        yield c


KEY = {"Authorization": "Bearer k1"}


async def test_every_pool_error_gets_its_status_from_the_one_table(client: Any) -> None:
    for i, (err, status, code) in enumerate(TABLE):
        r = await client.get(f"/raise/{i}", headers=KEY)
        body = await r.json()
        assert (r.status, body["error"]["code"]) == (status, code), err
        assert body["error"]["message"] == err.message
        # a 503 always says when to come back; nothing else does
        assert r.headers.get("Retry-After") == ("7" if status == 503 else None), err
    r = await client.get("/raise/6", headers=KEY)
    assert (await r.json())["error"]["diff"] == ["w: shape"]  # context goes to the body


async def test_an_unexpected_exception_is_a_500_with_details_only_in_the_log(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    r = await client.get("/raise/bug", headers=KEY)
    assert r.status == 500
    body = await r.json()
    assert body["error"]["code"] == "internal_error"
    assert "internal-detail-xyz" not in await r.text()
    assert "internal-detail-xyz" in caplog.text


async def test_aiohttp_errors_are_json_and_405_says_allow(client: Any) -> None:
    r = await client.get("/nowhere", headers=KEY)
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    for method in ("POST", "TRACE", "DELETE"):
        r = await client.request(method, "/ok", headers=KEY)
        assert r.status == 405, method
        assert r.headers["Allow"] == "GET"
        body = await r.json()
        assert body["error"]["code"] == "method_not_allowed" and body["error"]["allowed"] == ["GET"]
    r = await client.post("/echo", data=b'{"a": "' + b"x" * 100 + b'"}', headers=KEY)
    assert r.status == 413 and (await r.json())["error"]["code"] == "payload_too_large"
    r = await client.post("/echo", data=b"[1]", headers=KEY)
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_body"


async def test_auth_rules(client: Any) -> None:
    async def answer(path: str, token: str | None) -> tuple[int, str]:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        r = await client.get(path, headers=headers)
        body = await r.json()
        if r.status == 401:
            assert r.headers["WWW-Authenticate"] == "Bearer"
        return r.status, body.get("client") or body["error"]["code"]

    r = await client.get("/open")  # public: nobody is identified
    assert r.status == 200 and (await r.json())["client"] is None
    r = await client.get("/open", headers={"Authorization": "Bearer k0"})  # nor by a client key
    assert r.status == 200 and (await r.json())["client"] is None
    r = await client.get("/open", headers={"Authorization": "Bearer adm"})  # the admin is
    assert r.status == 200 and (await r.json())["client"] == "admin"
    assert await answer("/ok", None) == (401, "unauthorized")
    assert await answer("/ok", "nope") == (401, "unauthorized")
    # a key's identity is its fingerprint (stable across key order and routers), not the key
    assert await answer("/ok", "k0") == (200, f"key:{hashlib.sha256(b'k0').hexdigest()[:16]}")
    assert await answer("/ok", "k1") == (200, f"key:{hashlib.sha256(b'k1').hexdigest()[:16]}")
    assert await answer("/ok", "adm") == (200, "admin")  # the admin token is a client too
    assert await answer("/secret/x", None) == (401, "unauthorized")
    assert await answer("/secret/x", "k0") == (403, "forbidden")
    assert await answer("/secret/x", "adm") == (200, "admin")
    assert await answer("/secret/unknown", "k0") == (403, "forbidden")  # before routing


async def test_admin_disabled_and_open_data_plane() -> None:
    async def ok(request: web.Request) -> web.Response:
        return json_response({"client": request[CLIENT]})

    app = web.Application(
        middlewares=[
            error_middleware(log),
            auth_middleware(AuthPolicy(public=frozenset(), admin_prefixes=("/secret/",))),
        ]
    )
    app.router.add_get("/ok", ok)
    app.router.add_get("/secret/x", ok)
    async with TestClient(TestServer(app)) as c:
        r = await c.get("/ok")
        assert r.status == 200 and (await r.json())["client"].startswith("anonymous:")
        r = await c.get("/secret/x")  # no header: 401 first, whatever is configured
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        r = await c.get("/secret/x", headers={"Authorization": "Bearer anything"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"


class Probe(BaseModel):
    step: int
    ids: list[int]
    weight: float = 0.0


@pytest.mark.parametrize(
    "raw,ok",
    [
        ({"step": 1, "ids": [1, 2]}, True),
        ({"step": 1.0, "ids": [2.0], "weight": 3}, True),  # JSON Schema: 1.0 is an integer
        ({"step": True, "ids": []}, False),  # a boolean is not an integer
        ({"step": "1", "ids": []}, False),  # nor a string
        ({"step": 1.5, "ids": []}, False),
        ({"step": 1, "ids": [False]}, False),
    ],
)
def test_strict_validation_takes_json_integers_only(raw: dict[str, Any], ok: bool) -> None:
    try:
        probe = validate_strictly(Probe, raw)
    except ValidationError:
        assert not ok
    else:
        assert ok and type(probe.step) is int and all(type(i) is int for i in probe.ids)
