"""Upstream behaviour of the proxy against the vLLM stand-in (:mod:`testkit.standin`): slow
generations to disconnect from, cut or outlive deterministically, requests aborted while queued,
and, through the stand-in's answer faults (:class:`testkit.standin.Faults`), what a real server
cannot be told to produce: weight_versions spans and token ids that contradict the binding, HTTP
500/400 answers, connections dropped mid-answer, oversized bodies, a flood of events. The
stand-in's recording switch shows the exact body the router forwarded (cache_salt, model
rewrite, stripped fields), which a real server does not echo. The same paths against real vLLM
CPU servers are in ``tests/integration/test_router.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from jsonschema import Draft202012Validator

from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import BindingState, ReplicaState
from rolloutpool.local.models import ensure_model
from router import proxy
from router.app import create_app
from router.openapi import document
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client, settled
from testkit.redis_server import RedisServer
from testkit.standin import Faults, InferenceFailure, ReplicaConfig, StandinFleet, StandinReplica
from testkit.standin.protocol import check_cache_salt
from tests.helpers import aborted, active_rollouts, generating, idle, queued, taking

MODEL_PATH = "/fake/models/tiny"
T = TypeVar("T")


async def rigged_replica(fleet: StandinFleet, version: str = "0.32.0") -> StandinReplica:
    """A stand-in replica to set answer faults on: the tiny random model served as
    :data:`MODEL_PATH`, labelled ``g0`` (the label the bindings are bound to), one SSE event per
    token, recording the bodies it receives (:func:`forwarded`)."""
    config = ReplicaConfig(
        model=ensure_model("random", seed=1),
        served_model_name=MODEL_PATH,
        version=version,
        stream_per_token=True,
    )
    replica = await fleet.add(config)
    replica.live_engine().set_label("g0")
    replica.recorded = []
    return replica


@pytest.fixture
async def rigged() -> AsyncIterator[tuple[StandinReplica, str]]:
    """A vLLM 0.32 :func:`rigged_replica` and its URL."""
    async with StandinFleet() as fleet:
        replica = await rigged_replica(fleet)
        yield replica, replica.url


def forwarded(replica: StandinReplica) -> dict[str, Any]:
    """The body of the last inference request ``replica`` received."""
    assert replica.recorded, "no request recorded"
    return replica.recorded[-1]


def settings(**kw: Any) -> RouterSettings:
    base: dict[str, Any] = {"admission_wait_s": 0.5}
    base.update(kw)
    return RouterSettings(**base)


async def sse(resp: Any) -> list[Any]:
    events = []
    text = (await resp.read()).decode()
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def conforms(path: str, status: int, body: Any) -> bool:
    """Whether ``body`` is what the router's document declares for ``POST path``, ``status``."""
    doc = document()
    media = doc["paths"][path]["post"]["responses"][str(status)]["content"]["application/json"]
    schema = {**media["schema"], "components": doc["components"]}
    return not list(Draft202012Validator(schema).iter_errors(body))


async def no_leaks(store: RedisStore) -> None:
    assert [r.active for r in await store.replicas()] == [0]
    assert await store.leased_rollouts() == 0


async def test_forwarded_body_salt_model_and_provenance(
    rigged: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    replica, url = rigged
    await publish_ready(store, [("r0", url)], identity_digest="wid:1")
    async with router_client(settings(), store_settings) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "model": "rolloutpool",
                "prompt": "p q",
                "max_tokens": 2,
                "rollout": {"min_generation": 0},
            },
        )
        assert r.status == 200, await r.text()
        sent = forwarded(replica)
        assert sent["model"] == MODEL_PATH and sent["cache_salt"] == "g0"
        assert "rollout" not in sent and "return_weight_versions" not in sent  # 0.32
        body = await r.json()
        assert body["model"] == "rolloutpool"
        rid = body["rollout"]["id"]
        assert body["rollout"] == {
            "id": rid,
            "generation": 0,
            "label": "g0",
            "identity_digest": "wid:1",
            "replica": "r0",
        }
        assert {k: v for k, v in r.headers.items() if k.startswith("X-Rollout")} == {
            "X-Rollout-Id": rid,
            "X-Rollout-Generation": "0",
            "X-Rollout-Label": "g0",
            "X-Rollout-Identity": "wid:1",
            "X-Rollout-Replica": "r0",
        }
        b = await settled(store, rid)
        assert (b.state, b.prompt_tokens, b.completion_tokens) == (BindingState.FINISHED, 3, 2)

        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL_PATH,
                "messages": [{"role": "user", "content": "x"}],
                "cache_salt": "tenant-7",
            },
        )
        assert r.status == 200
        assert (
            forwarded(replica)["cache_salt"] == "g0:tenant-7"
            and forwarded(replica)["model"] == MODEL_PATH
        )
        assert (await r.json())["model"] == MODEL_PATH
        r = await c.post(
            "/inference/v1/generate",
            json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
        )
        assert r.status == 200 and forwarded(replica)["cache_salt"] == "g0"
        assert forwarded(replica)["model"] == MODEL_PATH
        r = await c.post("/v1/completions", json={"model": "other", "prompt": "p"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    await no_leaks(store)


def test_cache_salt_is_always_acceptable_to_vllm_032() -> None:
    """Pins the fix of salts vLLM 0.32 refuses with 400 (> 128 characters, or '@', '/', '\\',
    NUL): the router only hashed salts over 1024 characters, so such a client salt failed the
    request. Every forwarded salt now passes the stand-in's copy of vLLM's rule, still keys on
    the label, and distinct client salts stay distinct."""
    long_label = "L" * 128
    salts = ["tenant-7", "a/b", "user@host", "back\\slash", "nul\x00", "x" * 125, "y" * 2000]
    for label in ("g0", "g1", long_label):
        forwarded = [proxy.cache_salt(label, s) for s in salts]
        for salt in forwarded:
            check_cache_salt(salt)  # raises like vLLM 0.32 would answer 400
        assert len(set(forwarded)) == len(salts)
        if label != long_label:
            assert all(f.startswith(f"{label}:") for f in forwarded)
        assert proxy.cache_salt(label, None) == label
    assert proxy.cache_salt("g0", "tenant-7") == "g0:tenant-7"  # acceptable: kept readable
    assert proxy.cache_salt("g0", "a/b") != proxy.cache_salt("g1", "a/b")
    assert proxy.cache_salt(long_label, "t") != proxy.cache_salt("M" * 128, "t")


async def test_033_replicas_are_asked_for_spans(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    async with StandinFleet() as fleet:
        replica = await rigged_replica(fleet, version="0.33.0")
        await publish_ready(store, [("r0", replica.url)])
        async with router_client(settings(), store_settings) as c:
            r = await c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
            assert r.status == 200
            assert forwarded(replica)["return_weight_versions"] is True


@pytest.mark.parametrize(
    "spans,tokens,violation",
    [
        ([{"version": "g0", "start": 0, "end": 2}], [7, 8], None),
        ([], [], None),  # no tokens generated: no span needed
        ([{"version": "g-old", "start": 0, "end": 2}], [7, 8], "sampled under weight version"),
        (
            [{"version": "g0", "start": 0, "end": 1}, {"version": "g1", "start": 1, "end": 2}],
            [7, 8],
            "2 weight_versions spans",
        ),
        ([], [7, 8], "no weight_versions span"),
    ],
)
async def test_weight_versions_span_check(
    rigged: tuple[StandinReplica, str],
    store_settings: StoreSettings,
    store: RedisStore,
    spans: Any,
    tokens: list[int],
    violation: str | None,
) -> None:
    replica, url = rigged
    replica.faults = Faults(weight_versions=spans, token_ids=tokens)
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        r = await c.post(
            "/inference/v1/generate",
            json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}},
        )
        rid = r.headers["X-Rollout-Id"]
        answer = await r.json()
        b = await settled(store, rid)
        replica = await store.replica("r0")
        metrics = await (await c.get("/metrics")).text()
    if violation is None:
        assert r.status == 200 and b.state is BindingState.FINISHED
        assert replica.state is ReplicaState.READY
        return
    assert r.status == 502
    err = answer["error"]
    assert err["code"] == "provenance_violation" and violation in err["reason"]
    assert err["rollout"]["id"] == rid
    assert b.state is BindingState.VIOLATED and violation in b.reason
    assert replica.state is ReplicaState.TAINTED and "provenance violation" in replica.reason
    assert 'rolloutpool_violations_total{replica="r0"} 1.0' in metrics
    assert 'rolloutpool_rollouts_ended_total{state="violated"} 1.0' in metrics
    await no_leaks(store)


async def test_upstream_errors_abort_the_binding(
    rigged: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    replica, url = rigged
    await publish_ready(store, [("r0", url)])
    req = {"model": "rolloutpool", "prompt": "p"}
    async with router_client(settings(), store_settings) as c:
        replica.faults = Faults(fail_inference=InferenceFailure(status=500, message="bad things"))
        r = await c.post("/v1/completions", json=req)
        assert r.status == 502
        err = (await r.json())["error"]
        assert err["code"] == "upstream_error" and err["upstream_status"] == 500
        assert "upstream_body" not in err  # the replica's text goes to the log
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.reason) == (BindingState.ABORTED, "upstream 5xx: HTTP 500")

        replica.faults = Faults(fail_inference=InferenceFailure(status=400, message="bad things"))
        r = await c.post("/v1/completions", json=req)
        assert r.status == 400
        body = await r.json()
        assert body["error"]["message"] == "bad things"  # the replica's own body, passed through
        assert body["rollout"]["id"] == r.headers["X-Rollout-Id"]
        # ... and it is what the document declares (vLLM's error.code is an integer)
        assert conforms("/v1/completions", 400, body)
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.reason) == (BindingState.ABORTED, "upstream 4xx: HTTP 400")

        replica.faults = Faults(drop_inference=True)
        r = await c.post("/v1/completions", json=req)
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_unavailable"
        assert url.split("//")[1] not in await r.text()  # no replica URL
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert b.state is BindingState.ABORTED and "connection" in b.reason

        replica.faults = Faults(drop_stream_after=2)
        r = await c.post("/v1/completions", json={**req, "stream": True})
        assert r.status == 200
        events = await sse(r)
        assert "[DONE]" not in events and events[-1]["error"]["code"] == "upstream_error"
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert b.state is BindingState.ABORTED and "connection lost" in b.reason
    assert (await store.replica("r0")).state is ReplicaState.READY  # errors never taint
    await no_leaks(store)


async def test_buffered_upstream_bodies_are_capped(
    rigged: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """A whole (non-streamed) upstream answer was read without a cap."""
    replica, url = rigged
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(max_upstream_body_bytes=1024), store_settings) as c:
        for mode in (Faults(pad_bytes=4096), Faults(pad_bytes=4096, pad_chunked=True)):
            replica.faults = mode
            r = await c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
            assert r.status == 502, mode
            assert (await r.json())["error"]["code"] == "upstream_error"
            b = await settled(store, r.headers["X-Rollout-Id"])
            assert (b.state, b.reason) == (
                BindingState.ABORTED,
                "upstream body larger than 1024 bytes",
            )
        replica.faults = Faults()  # a body within the cap passes
        r = await c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
        assert r.status == 200
    await no_leaks(store)


async def test_requests_vllm_aborted_are_recorded_aborted(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """Pins the fix: a request vLLM aborted before its first token (an abort while it was
    queued) streams no choice chunk, only usage and ``[DONE]``; the router recorded it as
    ``finished`` with 0 tokens. It is now ``aborted`` with the reason; the client gets what vLLM
    sent (``[DONE]``, the rollout object on the usage chunk it asked for). The same for a whole
    answer whose choice ended with ``finish_reason: "abort"``. The stand-in gives what vLLM
    does: each request is queued behind a pause, then aborted by a pause in ``abort`` mode."""
    replica, url = upstream
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        body = {
            "model": "rolloutpool",
            "prompt": "p",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        r = await aborted_while_queued(replica, c.post("/v1/completions", json=body))
        assert r.status == 200
        events = await sse(r)
        assert events[-1] == "[DONE]" and events[0]["choices"] == []
        assert events[0]["rollout"]["id"] == r.headers["X-Rollout-Id"]
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.completion_tokens) == (BindingState.ABORTED, 0)
        assert b.reason == "upstream aborted the request before its first token"

        body = {"model": "rolloutpool", "prompt": "p"}
        r = await aborted_while_queued(replica, c.post("/v1/completions", json=body))
        assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] == "abort"
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.reason) == (
            BindingState.ABORTED,
            "upstream aborted the request (finish_reason 'abort') after 0 tokens",
        )
    await no_leaks(store)


async def aborted_while_queued(replica: StandinReplica, post: Awaitable[T]) -> T:
    """``post``'s answer, its request queued behind a pause of ``replica`` and then aborted, as
    a pause in ``abort`` mode aborts what waits on vLLM."""
    engine = replica.live_engine()
    engine.pause("keep", clear_cache=False)
    call = asyncio.ensure_future(post)
    await queued(replica)
    engine.pause("abort", clear_cache=False)
    engine.resume()
    return await call


async def test_stream_passthrough_shape(
    rigged: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """The forwarded stream request and the framing of the client's stream."""
    replica, url = rigged
    replica.faults = Faults(token_ids=(1, 2, 3))
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        r = await c.post(
            "/v1/completions",
            json={"model": "rolloutpool", "prompt": "p q r", "max_tokens": 3, "stream": True},
        )
        assert r.headers["Content-Type"].startswith("text/event-stream")
        rid = r.headers["X-Rollout-Id"]
        events = await sse(r)
        assert forwarded(replica)["stream_options"] == {"include_usage": True}
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[1], [2], [3]]  # no usage
        assert all(c["model"] == "rolloutpool" for c in chunks)
        assert chunks[-1]["rollout"]["id"] == rid and "rollout" not in chunks[0]
        b = await settled(store, rid)
        assert (b.state, b.prompt_tokens, b.completion_tokens) == (BindingState.FINISHED, 4, 3)

        r = await c.post(
            "/v1/completions",
            json={
                "model": "rolloutpool",
                "prompt": "p q r",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        chunks = (await sse(r))[:-1]
        assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
        assert chunks[-1]["rollout"]["id"] == r.headers["X-Rollout-Id"]

        replica.faults = Faults(
            token_ids=(1, 2, 3), weight_versions=[{"version": "g9", "start": 0, "end": 3}]
        )
        r = await c.post(
            "/inference/v1/generate",
            json={
                "token_ids": [1],
                "sampling_params": {"max_tokens": 3},
                "stream": True,
            },
        )
        events = await sse(r)
        assert events[-1]["error"]["code"] == "provenance_violation"
        assert "g9" in events[-2]["rollout"]["violation"]
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert b.state is BindingState.VIOLATED
    assert (await store.replica("r0")).state is ReplicaState.TAINTED
    await no_leaks(store)


async def test_client_disconnect_mid_stream_aborts_upstream_and_binding(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    replica, url = upstream
    taking(replica, 10.0)  # a slow stream
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(), store_settings) as c:
        r = await c.post(
            "/v1/completions", json={"model": "rolloutpool", "prompt": "p", "stream": True}
        )
        rid = r.headers["X-Rollout-Id"]
        (generation,) = await generating(replica)
        assert (await r.content.readuntil(b"\n\n")).startswith(b"data: ")
        r.close()  # drop the connection mid-stream
        await aborted(generation)
        for _ in range(100):
            b = await settled(store, rid)
            if b.state is not BindingState.ACTIVE:
                break
            await asyncio.sleep(0.05)
        assert (b.state, b.reason) == (BindingState.ABORTED, "client disconnected")
    await no_leaks(store)


async def test_client_disconnect_while_waiting_aborts_upstream_and_binding(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    replica, url = upstream
    taking(replica, 30.0)
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(grants=False), store_settings) as c:
        task = asyncio.create_task(
            c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
        )
        (generation,) = await generating(replica)
        (rid,) = await active_rollouts(store, "r0")
        task.cancel()
        await aborted(generation)
        for _ in range(100):
            b = await settled(store, rid)
            if b.state is not BindingState.ACTIVE:
                break
            await asyncio.sleep(0.05)
        assert (b.state, b.reason) == (BindingState.ABORTED, "client disconnected")
    await no_leaks(store)


async def test_long_request_keeps_its_lease(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """A generation longer than the request lease is not reaped: the router renews it."""
    replica, url = upstream
    taking(replica, 1.0)
    await publish_ready(store, [("r0", url)])
    s = settings(request_lease_s=0.3, reaper_interval_s=0.05)
    async with router_client(s, store_settings) as c:
        r = await c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
        assert r.status == 200
        b = await settled(store, r.headers["X-Rollout-Id"])
        assert b.state is BindingState.FINISHED, b.reason
    await no_leaks(store)


async def test_disconnect_is_noticed_without_handler_cancellation(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """The fallback documented in router.proxy: served without handler cancellation, a failed
    SSE write still closes the upstream and aborts the binding."""
    replica, url = upstream
    taking(replica, 10.0)  # a slow stream
    await publish_ready(store, [("r0", url)])
    app = create_app(settings(), store_settings)
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as s:
            r = await s.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "rolloutpool", "prompt": "p", "stream": True},
            )
            rid = r.headers["X-Rollout-Id"]
            (generation,) = await generating(replica)
            await r.content.readuntil(b"\n\n")
            r.close()
        await aborted(generation)
        for _ in range(100):
            b = await settled(store, rid)
            if b.state is not BindingState.ACTIVE:
                break
            await asyncio.sleep(0.05)
        assert (b.state, b.reason) == (BindingState.ABORTED, "client disconnected")
    finally:
        await runner.cleanup()
    await no_leaks(store)


async def test_output_is_withheld_when_the_binding_ends_under_the_request(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """The updater aborts bindings at a drain deadline (then pauses and updates the replica):
    output of a request whose binding was ended while it ran is never delivered."""
    replica, url = upstream
    taking(replica, 0.5)
    await publish_ready(store, [("r0", url)])
    req = {"model": "rolloutpool", "prompt": "p"}
    async with router_client(settings(grants=False), store_settings) as c:

        async def abort_when_received() -> list[str]:
            await generating(replica)
            return await store.abort_active("r0", "drain deadline")

        for body in (req, {**req, "stream": True}):
            answer, ended_ids = await asyncio.gather(
                c.post("/v1/completions", json=body), abort_when_received()
            )
            rid = answer.headers["X-Rollout-Id"]
            assert ended_ids == [rid]
            if body.get("stream"):
                events = await sse(answer)
                assert "[DONE]" not in events
                assert events[-1]["error"]["code"] == "binding_ended"
                assert events[-2]["rollout"]["unconfirmed"] is True
            else:
                assert answer.status == 503
                err = (await answer.json())["error"]
                assert err["code"] == "binding_ended" and err["reason"] == "drain deadline"
                assert "choices" not in await answer.text()
            b = await store.binding(rid)
            assert (b.state, b.reason) == (BindingState.ABORTED, "drain deadline")
            await idle(replica)

        sid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]

        async def close_when_received() -> int:
            await generating(replica)
            return (await c.post(f"/v1/rollouts/{sid}/close")).status

        answer, closed = await asyncio.gather(
            c.post("/v1/completions", json=req, headers={"X-Rollout-Id": sid}),
            close_when_received(),
        )
        assert closed == 200 and answer.status == 409
        assert (await answer.json())["error"]["code"] == "binding_ended"
    await no_leaks(store)


async def test_spans_after_the_binding_ended_do_not_taint(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """The proxy tainted the replica before settling, so spans of the
    next generation on a request whose binding the updater had already aborted (drain deadline,
    then a legitimate weight change) took a healthy replica out of service."""
    async with StandinFleet() as fleet:  # a 0.33 replica: its answers carry spans
        model = ensure_model("random", seed=1)
        replica = await fleet.add(ReplicaConfig(model=model, version="0.33.0"))
        await spans_after_the_binding_ended(replica, store_settings, store)


async def spans_after_the_binding_ended(
    replica: StandinReplica, store_settings: StoreSettings, store: RedisStore
) -> None:
    taking(replica, 0.3)
    replica.live_engine().set_label("g1")  # the weights the updater loaded next: spans name g1
    await publish_ready(store, [("r0", replica.url)])
    req = {"model": "rolloutpool", "prompt": "p"}
    async with router_client(settings(grants=False), store_settings) as c:

        async def abort_when_received() -> list[str]:
            await generating(replica)
            return await store.abort_active("r0", "drain deadline")

        for body in (req, {**req, "stream": True}):
            answer, ended_ids = await asyncio.gather(
                c.post("/v1/completions", json=body), abort_when_received()
            )
            assert ended_ids == [answer.headers["X-Rollout-Id"]]
            if body.get("stream"):
                events = await sse(answer)
                assert events[-1]["error"]["code"] == "binding_ended"
            else:
                assert answer.status == 503
                assert (await answer.json())["error"]["code"] == "binding_ended"
            b = await store.binding(answer.headers["X-Rollout-Id"])
            assert (b.state, b.reason) == (BindingState.ABORTED, "drain deadline")
            await idle(replica)
        metrics = await (await c.get("/metrics")).text()
    assert (await store.replica("r0")).state is ReplicaState.READY
    assert 'rolloutpool_violations_total{replica="r0"}' not in metrics
    await no_leaks(store)


async def test_output_is_withheld_when_the_store_cannot_confirm(
    upstream: tuple[StandinReplica, str], tmp_path: Path
) -> None:
    """Redis goes away while a request runs: the answer is withheld (fail closed)."""
    replica, url = upstream
    taking(replica, 0.5)
    redis = RedisServer(tmp_path / "redis").start()
    try:
        ss = StoreSettings(url=redis.url, namespace="confirm", socket_timeout_s=0.3)
        store = RedisStore.connect(ss)
        await publish_ready(store, [("r0", url)])
        await store.close()
        async with router_client(settings(grants=False), ss) as c:

            async def stop_redis() -> None:
                await generating(replica)
                redis.stop()

            answer, _ = await asyncio.gather(
                c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"}),
                stop_redis(),
            )
            assert answer.status == 503
            err = (await answer.json())["error"]
            assert err["code"] == "store_unavailable"
            assert err["rollout"]["id"] == answer.headers["X-Rollout-Id"]
    finally:
        redis.stop()


KEY_A, KEY_B, ADMIN = "key-A-1111", "key-B-2222", "adm-3333"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def ended(store: RedisStore, rid: str) -> Any:
    """The binding once it is no longer active (polled, at most 10 s)."""
    b = await settled(store, rid)
    assert b.state is not BindingState.ACTIVE, f"{rid} is still active"
    return b


async def test_a_request_ends_at_its_deadline(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """Nothing bounded a whole request or stream (only the replica's
    silence). Past request_deadline_s it is aborted with the reason, upstream closed."""
    replica, url = upstream
    await publish_ready(store, [("r0", url)])
    reason = "request deadline of 0.4 s exceeded"
    async with router_client(settings(request_deadline_s=0.4), store_settings) as c:
        taking(replica, 30.0)
        call = asyncio.create_task(
            c.post("/v1/completions", json={"model": "rolloutpool", "prompt": "p"})
        )
        (generation,) = await generating(replica)
        r = await call
        assert r.status == 504
        err = (await r.json())["error"]
        assert err["code"] == "deadline_exceeded" and reason in err["message"]
        await aborted(generation)
        b = await ended(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.reason) == (BindingState.ABORTED, reason)

        taking(replica, 10.0)  # a stream that would take 10 s
        r = await c.post(
            "/v1/completions", json={"model": "rolloutpool", "prompt": "p", "stream": True}
        )
        events = await sse(r)
        assert events[-1]["error"]["code"] == "deadline_exceeded" and "[DONE]" not in events
        b = await ended(store, r.headers["X-Rollout-Id"])
        assert (b.state, b.reason) == (BindingState.ABORTED, reason)
    await no_leaks(store)


async def test_a_sessions_request_ends_at_the_sessions_max_age(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    replica, url = upstream
    taking(replica, 10.0)  # a slow stream
    await publish_ready(store, [("r0", url)])
    s = settings(session_max_age_s=0.6, reaper_interval_s=0.05)
    async with router_client(s, store_settings) as c:
        sid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        r = await c.post(
            "/v1/completions",
            json={"model": "rolloutpool", "prompt": "p", "stream": True},
            headers={"X-Rollout-Id": sid},
        )
        events = await sse(r)
        assert events[-1]["error"]["code"] in ("deadline_exceeded", "binding_ended")
        b = await ended(store, sid)
    assert (b.state, b.reason) == (BindingState.ABORTED, "session reached its maximum age of 0.6 s")
    await no_leaks(store)


async def test_a_client_that_stops_reading_a_stream_loses_its_binding(
    rigged: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """A client that stopped reading an SSE stream held its binding
    (and the replica's drain) indefinitely. A write blocked for client_write_timeout_s ends it."""
    replica, url = rigged
    taking(replica, 10.0)  # a generation still running when the flood stops
    replica.faults = Faults(flood_events=4096)  # 64 KiB events: up to 256 MiB
    await publish_ready(store, [("r0", url)])
    async with router_client(settings(client_write_timeout_s=0.3), store_settings) as c:
        r = await c.post(
            "/v1/completions", json={"model": "rolloutpool", "prompt": "p", "stream": True}
        )
        rid = r.headers["X-Rollout-Id"]  # ... and the client reads nothing more
        (generation,) = await generating(replica)
        b = await ended(store, rid)
        assert b.state is BindingState.ABORTED
        assert b.reason == "client stopped reading: an event waited 0.3 s to be sent"
        await aborted(generation)  # the generation is stopped too
        r.close()
    await no_leaks(store)


async def test_requests_in_flight_per_client_and_per_session_are_capped(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """No per-client quota on requests; one session ran 52
    concurrent requests on a capacity-1 replica. Over a limit → 429 with Retry-After."""
    replica, url = upstream
    taking(replica, 30.0)
    await publish_ready(store, [("r0", url)], capacity=8)
    s = settings(api_keys=[KEY_A, KEY_B], admin_token=ADMIN, client_max_in_flight=1)
    req = {"model": "rolloutpool", "prompt": "p"}
    async with router_client(s, store_settings) as c:
        held = [asyncio.create_task(c.post("/v1/completions", json=req, headers=auth(KEY_A)))]
        await generating(replica, 1)
        r = await c.post("/v1/completions", json=req, headers=auth(KEY_A))
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == "client_in_flight" and "client_max_in_flight" in err["message"]

        sid = (await (await c.post("/v1/rollouts", headers=auth(KEY_B))).json())["rollout_id"]
        on_session = {**auth(KEY_B), "X-Rollout-Id": sid}
        held.append(asyncio.create_task(c.post("/v1/completions", json=req, headers=on_session)))
        await generating(replica, 2)
        r = await c.post("/v1/completions", json=req, headers={**auth(ADMIN), "X-Rollout-Id": sid})
        assert r.status == 429  # one request per session at a time, whoever sends it
        err = (await r.json())["error"]
        assert err["code"] == "session_busy" and "session_max_in_flight" in err["message"]
        assert (await store.binding(sid)).requests == 1
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        r = await c.post(f"/v1/rollouts/{sid}/close", headers=auth(KEY_B))
        assert r.status == 200
    for _ in range(100):
        if await store.leased_rollouts() == 0:
            break
        await asyncio.sleep(0.05)
    await no_leaks(store)
