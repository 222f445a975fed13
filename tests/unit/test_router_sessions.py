"""Session lifecycle and its errors, provenance records and the reaper, with a real Redis and
no vLLM: none of these paths forwards a request (replica URLs point at closed ports)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import BindingState
from router.keys import STORE
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client
from tests.helpers import active_rollouts

DEAD = "http://127.0.0.1:1"
BODY = {"model": "rolloutpool", "prompt": "hello", "max_tokens": 1}


def settings(**kw: Any) -> RouterSettings:
    base: dict[str, Any] = {"admission_wait_s": 0.2, "session_lease_s": 30.0}
    base.update(kw)
    return RouterSettings(**base)


async def wait_for_state(store: RedisStore, rid: str, timeout_s: float = 5.0) -> BindingState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = (await store.binding(rid)).state
        if state is not BindingState.ACTIVE or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


async def test_session_lifecycle(store_settings: StoreSettings, store: RedisStore) -> None:
    await publish_ready(store, [("r0", DEAD)], identity_digest="wid:abc")
    async with router_client(settings(), store_settings) as c:
        r = await c.post("/v1/rollouts", json={"min_generation": 0})
        assert r.status == 201, await r.text()
        s = await r.json()
        rid = s["rollout_id"]
        assert rid.startswith("ro-") and r.headers["X-Rollout-Id"] == rid
        assert (s["generation"], s["label"], s["identity_digest"], s["replica"]) == (
            0,
            "g0",
            "wid:abc",
            "r0",
        )
        b = await store.binding(rid)
        assert b.session and b.state is BindingState.ACTIVE
        assert s["lease_expires_ms"] == b.lease_expires_ms

        r = await c.get(f"/v1/rollouts/{rid}")
        assert r.status == 200
        record = await r.json()
        assert record["state"] == "active" and record["session"] is True
        assert r.headers["X-Rollout-Label"] == "g0"

        await asyncio.sleep(0.01)
        r = await c.post(f"/v1/rollouts/{rid}/heartbeat")
        assert r.status == 200
        assert (await r.json())["lease_expires_ms"] > s["lease_expires_ms"]

        r = await c.post(f"/v1/rollouts/{rid}/close")
        assert r.status == 200
        closed = await r.json()
        assert closed["state"] == "finished" and closed["reason"] == "closed by client"
        assert closed["finished_ms"] >= closed["created_ms"]

        for method, path, body in [
            ("POST", f"/v1/rollouts/{rid}/close", None),
            ("POST", f"/v1/rollouts/{rid}/heartbeat", None),
            ("POST", "/v1/completions", BODY),
        ]:
            r = await c.request(method, path, json=body, headers={"X-Rollout-Id": rid})
            assert r.status == 409, path
            err = (await r.json())["error"]
            assert err["code"] == "rollout_not_active" and err["state"] == "finished"
    assert (await store.replica("r0")).active == 0
    assert await store.leased_rollouts() == 0


async def test_unknown_and_non_session_ids(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    await store.admit("ro-single", "r0")  # a one-request rollout (another router's)
    async with router_client(settings(), store_settings) as c:
        for method, path in [
            ("GET", "/v1/rollouts/ro-nope"),
            ("POST", "/v1/rollouts/ro-nope/heartbeat"),
            ("POST", "/v1/rollouts/ro-nope/close"),
        ]:
            r = await c.request(method, path)
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "rollout_not_found"
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Id": "ro-nope"})
        assert r.status == 404
        for path in ["/v1/rollouts/ro-single/heartbeat", "/v1/rollouts/ro-single/close"]:
            r = await c.post(path)
            assert r.status == 409
            assert (await r.json())["error"]["code"] == "not_a_session"
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Id": "ro-single"})
        assert r.status == 409
        assert (await store.binding("ro-single")).state is BindingState.ACTIVE
        r = await c.post("/v1/rollouts", data=b"[1]")
        assert r.status == 400
        r = await c.post("/v1/rollouts", json={"generation": "x"})
        assert r.status == 400
    await store.release("ro-single", "r0")


async def test_session_request_constraints_and_tainted_replica(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    async with router_client(settings(), store_settings) as c:
        rid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        r = await c.post(
            "/v1/completions", json=BODY, headers={"X-Rollout-Id": rid, "X-Rollout-Generation": "3"}
        )
        assert r.status == 409
        assert (await r.json())["error"]["code"] == "generation_unsatisfiable"
        assert (await store.binding(rid)).requests == 0

        await store.taint("r0", "engine died", source="test")
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Id": rid})
        assert r.status == 409
        assert (await r.json())["error"]["code"] == "session_replica_unavailable"
        b = await store.binding(rid)
        assert b.state is BindingState.ABORTED and b.reason == "replica TAINTED"
    assert await store.leased_rollouts() == 0


async def test_session_request_to_dead_replica_keeps_the_session(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    async with router_client(settings(), store_settings) as c:
        rid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        r = await c.post("/v1/completions", json=BODY, headers={"X-Rollout-Id": rid})
        assert r.status == 502 and r.headers["X-Rollout-Id"] == rid
        b = await store.binding(rid)
        assert b.state is BindingState.ACTIVE and b.requests == 1
        assert (await c.post(f"/v1/rollouts/{rid}/close")).status == 200
    assert await store.leased_rollouts() == 0


async def test_reaper_aborts_expired_session(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    s = settings(session_lease_s=0.3, reaper_interval_s=0.05)
    async with router_client(s, store_settings) as c:
        rid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        assert await wait_for_state(store, rid) is BindingState.ABORTED
        assert (await store.binding(rid)).reason == "lease expired"
        r = await c.post(f"/v1/rollouts/{rid}/heartbeat")
        assert r.status == 409


async def test_reaper_aborts_a_killed_routers_request(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """A router SIGKILLed mid-request leaves a binding whose lease nobody renews; any other
    router's reaper aborts it."""
    await publish_ready(store, [("r0", DEAD)])
    await store.admit("ro-orphan", "r0", lease_s=0.2)  # what the dead router left behind
    await store.admit("ro-alive", "r0", lease_s=60)
    s = settings(reaper_interval_s=0.05)
    async with router_client(s, store_settings):
        assert await wait_for_state(store, "ro-orphan") is BindingState.ABORTED
    orphan = await store.binding("ro-orphan")
    assert orphan.reason == "lease expired"
    assert (await store.binding("ro-alive")).state is BindingState.ACTIVE
    assert await active_rollouts(store, "r0") == {"ro-alive"}
    await store.release("ro-alive", "r0")


KEY_A, KEY_B, ADMIN = "key-A-1111", "key-B-2222", "adm-3333"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def heartbeat_until_refused(c: Any, rid: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Heartbeat (as a well-behaved client would) until the router refuses; that answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = await c.post(f"/v1/rollouts/{rid}/heartbeat")
        if r.status != 200:
            assert r.status == 409, await r.text()
            return (await r.json())["error"]  # type: ignore[no-any-return]
        await asyncio.sleep(0.05)
    raise AssertionError("the session outlived its limit")


async def test_a_heartbeating_session_ends_at_its_max_age(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """A heartbeating session never ended (and kept a replica
    DRAINING under drain_policy wait). It ends at session_max_age_s, with the reason."""
    await publish_ready(store, [("r0", DEAD)])
    s = settings(session_max_age_s=0.5, reaper_interval_s=0.05)
    async with router_client(s, store_settings) as c:
        t0 = time.monotonic()
        opened = await (await c.post("/v1/rollouts")).json()
        assert opened["deadline_ms"] - opened["lease_expires_ms"] == 0  # lease capped by age
        err = await heartbeat_until_refused(c, opened["rollout_id"])
        assert time.monotonic() - t0 >= 0.5
    reason = "session reached its maximum age of 0.5 s"
    assert err["code"] == "rollout_not_active" and err["reason"] == reason
    b = await store.binding(opened["rollout_id"])
    assert (b.state, b.reason) == (BindingState.ABORTED, reason)
    assert await store.leased_rollouts() == 0


async def test_a_session_that_only_heartbeats_ends_at_its_idle_limit(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD)])
    s = settings(session_idle_s=0.4, reaper_interval_s=0.05)
    async with router_client(s, store_settings) as c:
        rid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        err = await heartbeat_until_refused(c, rid)
    reason = "session idle: no request for 0.4 s"
    assert err["reason"] == reason
    assert (await store.binding(rid)).reason == reason
    assert await store.leased_rollouts() == 0


async def test_a_heartbeat_that_loses_the_race_with_the_reaper_says_why(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """A reaper (any router's) ends the session between the heartbeat's read of the binding and
    its lease renewal. The 409 must still carry the reason the session ended with; before, it
    said only "expired" and had no ``reason`` (seen as a flaky idle-limit test under load)."""
    await publish_ready(store, [("r0", DEAD)])
    async with router_client(settings(), store_settings) as c:
        rid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        app_store = c.app[STORE]
        touch = app_store.touch

        async def reaped_first(rollout_id: str, **kw: Any) -> int:
            b = await store.binding(rollout_id)
            await store.release(rollout_id, b.replica_id, BindingState.ABORTED, reason="idle")
            return await touch(rollout_id, **kw)

        app_store.touch = reaped_first  # type: ignore[method-assign]
        r = await c.post(f"/v1/rollouts/{rid}/heartbeat")
        assert r.status == 409
        err = (await r.json())["error"]
    assert (err["code"], err["state"], err["reason"]) == ("rollout_not_active", "aborted", "idle")


async def test_sessions_belong_to_the_client_that_opened_them(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """Any client that knew a session's id could use, read or close
    it. Another client is told it does not exist; the admin token may read it."""
    await publish_ready(store, [("r0", DEAD)])
    s = settings(api_keys=[KEY_A, KEY_B], admin_token=ADMIN)
    async with router_client(s, store_settings) as c:
        rid = (await (await c.post("/v1/rollouts", headers=auth(KEY_A))).json())["rollout_id"]
        single = await c.post("/v1/completions", json=BODY, headers=auth(KEY_A))
        assert single.status == 502  # admitted, then the dead upstream
        one = single.headers["X-Rollout-Id"]
        for method, path, body, headers in [
            ("GET", f"/v1/rollouts/{rid}", None, {}),
            ("GET", f"/v1/rollouts/{one}", None, {}),
            ("POST", f"/v1/rollouts/{rid}/heartbeat", None, {}),
            ("POST", f"/v1/rollouts/{rid}/close", None, {}),
            ("POST", "/v1/completions", BODY, {"X-Rollout-Id": rid}),
        ]:
            r = await c.request(method, path, json=body, headers={**auth(KEY_B), **headers})
            assert r.status == 404, path
            assert (await r.json())["error"]["code"] == "rollout_not_found"
        b = await store.binding(rid)
        assert b.state is BindingState.ACTIVE and b.requests == 0 and b.client.startswith("key:")
        r = await c.get(f"/v1/rollouts/{rid}", headers=auth(ADMIN))
        assert r.status == 200 and (await r.json())["client"] == b.client
        assert (await c.post(f"/v1/rollouts/{rid}/heartbeat", headers=auth(KEY_A))).status == 200
        assert (await c.post(f"/v1/rollouts/{rid}/close", headers=auth(KEY_A))).status == 200
    assert await store.leased_rollouts() == 0


async def test_a_clients_open_sessions_are_capped(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """No per-client quota. Over client_max_sessions → 429."""
    await publish_ready(store, [("r0", DEAD)])
    s = settings(api_keys=[KEY_A, KEY_B], admin_token=ADMIN, client_max_sessions=2)
    async with router_client(s, store_settings) as c:
        ids = [
            (await (await c.post("/v1/rollouts", headers=auth(KEY_A))).json())["rollout_id"]
            for _ in range(2)
        ]
        r = await c.post("/v1/rollouts", headers=auth(KEY_A))
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == "client_sessions" and err["limit"] == 2
        assert "client_max_sessions" in err["message"]
        assert (await c.post("/v1/rollouts", headers=auth(KEY_B))).status == 201
        assert (await c.post("/v1/rollouts", headers=auth(ADMIN))).status == 201  # exempt
        assert (await c.post(f"/v1/rollouts/{ids[0]}/close", headers=auth(KEY_A))).status == 200
        assert (await c.post("/v1/rollouts", headers=auth(KEY_A))).status == 201
        metrics = await (await c.get("/metrics")).text()
    assert 'rolloutpool_admission_refusals_total{reason="client_sessions"} 1.0' in metrics
    await store.abort_active("r0", "test over")
