"""The router's client limits against the pool's size, with a real Redis: quotas derived from
the pool's capacity, one session's requests limited across routers (each router here stands
for a worker of ``--workers N``: both are whole routers on one store), and requests that ask
for more than one sequence (``n``, ``best_of``, prompt arrays)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.web import BadRequest
from router.keys import RUNS
from router.limits import sequences
from testkit.harness import publish_ready, router_client
from testkit.standin import StandinReplica, TimeModel
from tests.helpers import generating, taking
from tests.unit.test_router_upstream import no_leaks, settings

DEAD = "http://127.0.0.1:1"
KEY_A, KEY_B, ADMIN = "key-A-1111", "key-B-2222", "adm-3333"
TOKENS = 1
REQ = {"model": "rolloutpool", "prompt": "p", "max_tokens": TOKENS}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def open_sessions(c: Any, token: str, n: int) -> list[int]:
    return [(await c.post("/v1/rollouts", headers=auth(token))).status for _ in range(n)]


async def test_by_default_one_client_holds_at_most_half_the_pool_in_sessions(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before, the default quota was 1,024 sessions: one key's idle sessions took every slot of
    a 2-replica pool and every other client got 503. Unset, the quota is half the pool's
    capacity (2 replicas of 4: 4 sessions), so another client still finds room."""
    await publish_ready(store, [("r0", DEAD), ("r1", DEAD)], capacity=4)
    s = settings(api_keys=[KEY_A, KEY_B], admin_token=ADMIN, admission_wait_s=0.2, grants=False)
    async with router_client(s, store_settings) as c:
        assert await open_sessions(c, KEY_A, 4) == [201] * 4
        r = await c.post("/v1/rollouts", headers=auth(KEY_A))
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert (err["code"], err["limit"]) == ("client_sessions", 4)
        assert await open_sessions(c, KEY_B, 4) == [201] * 4
    assert s.client_max_sessions is None and s.client_max_in_flight is None  # the defaults
    await store.abort_active("r0", "test over")
    await store.abort_active("r1", "test over")


async def test_an_explicit_session_quota_is_kept_and_0_disables_it(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    await publish_ready(store, [("r0", DEAD), ("r1", DEAD)], capacity=4)
    for quota, opened in [(5, [201] * 5 + [429]), (0, [201] * 8 + [503])]:
        s = settings(
            api_keys=[KEY_A], client_max_sessions=quota, admission_wait_s=0.2, grants=False
        )
        async with router_client(s, store_settings) as c:
            assert await open_sessions(c, KEY_A, len(opened)) == opened
        await store.abort_active("r0", "test over")
        await store.abort_active("r1", "test over")


async def test_by_default_a_clients_requests_in_flight_are_capped_at_the_pools_capacity(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before, 1,024 requests per client could be in flight (queued past the pool's capacity).
    Unset, the limit is the pool's capacity: a third request on a pool of 2 slots is 429."""
    replica, url = upstream
    taking(replica, 30.0, tokens=TOKENS)
    await publish_ready(store, [("r0", url)], capacity=2)
    s = settings(api_keys=[KEY_A, KEY_B], admission_wait_s=0.2)
    async with router_client(s, store_settings) as c:
        held = [
            asyncio.create_task(c.post("/v1/completions", json=REQ, headers=auth(KEY_A)))
            for _ in range(2)
        ]
        await generating(replica, 2)
        r = await c.post("/v1/completions", json=REQ, headers=auth(KEY_A))
        assert r.status == 429, await r.text()
        err = (await r.json())["error"]
        assert (err["code"], err["limit"]) == ("client_in_flight", 2)
        assert (await c.post("/v1/completions", json=REQ, headers=auth(KEY_B))).status == 503
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    for _ in range(100):
        if await store.leased_rollouts() == 0:
            break
        await asyncio.sleep(0.05)


async def test_a_sessions_requests_are_limited_across_routers(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before, session_max_in_flight was counted per worker: under ``--workers 2`` one session
    ran two requests at once on one slot. Now a second request through another router (or
    worker) is 429 ``session_busy`` while the first runs; once it ended, the next one runs.
    A mark nobody renews (a dead worker's) lapses with its lease."""
    replica, url = upstream
    taking(replica, 1.0, tokens=TOKENS)
    await publish_ready(store, [("r0", url)], capacity=4)
    s = settings(request_lease_s=0.6, grants=False)  # sessions only: no slot held in advance
    async with router_client(s, store_settings) as c1, router_client(s, store_settings) as c2:
        sid = (await (await c1.post("/v1/rollouts")).json())["rollout_id"]
        on_session = {"X-Rollout-Id": sid}
        first = asyncio.create_task(c1.post("/v1/completions", json=REQ, headers=on_session))
        await generating(replica)
        r = await c2.post("/v1/completions", json=REQ, headers=on_session)
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
        assert err["code"] == "session_busy" and "session_max_in_flight" in err["message"]
        assert err["limit"] == 1
        assert (await first).status == 200  # ran past its 0.6 s lease: renewed meanwhile
        assert (await store.binding(sid)).requests == 1
        r = await c2.post("/v1/completions", json=REQ, headers=on_session)
        assert r.status == 200, await r.text()

        # what a worker killed mid-request leaves: a mark that lapses in 0.3 s
        now_ms = int(time.time() * 1000)
        await store.r.zadd(c2.app[RUNS].key(sid), {"dead-worker": now_ms + 300})
        r = await c1.post("/v1/completions", json=REQ, headers=on_session)
        assert r.status == 429
        await asyncio.sleep(0.4)
        r = await c1.post("/v1/completions", json=REQ, headers=on_session)
        assert r.status == 200, await r.text()
        assert (await c1.post(f"/v1/rollouts/{sid}/close")).status == 200
        for _ in range(50):  # marks are removed in the background after the answer
            if not await store.r.exists(c1.app[RUNS].key(sid)):
                break
            await asyncio.sleep(0.02)
        assert not await store.r.exists(c1.app[RUNS].key(sid))
    await no_leaks(store)


async def test_a_session_is_free_again_by_the_time_its_answer_arrives(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """A client sends its next turn as soon as it has the answer. The request's mark must be
    gone by then (removed when the request is settled, before the answer or a stream's last
    chunk is delivered); removed after delivery, the next turn could find its own previous
    request still running and get 429 ``session_busy``."""
    _, url = upstream
    await publish_ready(store, [("r0", url)], capacity=4)
    async with router_client(settings(grants=False), store_settings) as c:
        sid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        key = c.app[RUNS].key(sid)
        for turn in range(20):
            stream = turn % 2 == 1
            r = await c.post(
                "/v1/completions", json={**REQ, "stream": stream}, headers={"X-Rollout-Id": sid}
            )
            text = await r.text()
            assert r.status == 200 and (not stream or "[DONE]" in text), text
            assert not await store.r.exists(key), (
                f"turn {turn}: the answer came before the mark went"
            )
        assert (await store.binding(sid)).requests == 20
        assert (await c.post(f"/v1/rollouts/{sid}/close")).status == 200
    await no_leaks(store)


@pytest.mark.parametrize(
    ("route", "body", "count", "fields"),
    [
        ("/v1/completions", {"prompt": "p"}, 1, ()),
        ("/v1/completions", {"prompt": [1, 2, 3], "n": 1}, 1, ()),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, 6, ("n", "prompt")),
        ("/v1/completions", {"prompt": [[1], [2], [3]]}, 3, ("prompt",)),
        ("/v1/completions", {"prompt": "p", "n": 2, "best_of": 5}, 5, ("n", "best_of")),
        ("/v1/chat/completions", {"messages": [], "n": 4, "prompt": ["a", "b"]}, 4, ("n",)),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"n": 8}},
            8,
            ("sampling_params.n",),
        ),
        ("/inference/v1/generate", {"token_ids": [1], "n": 8}, 1, ()),
    ],
)
def test_sequences_a_request_asks_for(
    route: str, body: dict[str, Any], count: int, fields: tuple[str, ...]
) -> None:
    seqs = sequences(route, body)
    assert (seqs.count, seqs.fields) == (count, fields)


@pytest.mark.parametrize("bad", ["4", 0, -1, 2.0, True])
def test_n_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(BadRequest) as e:
        sequences("/v1/completions", {"prompt": "p", "n": bad})
    assert e.value.code == "invalid_body" and e.value.context["field"] == "n"


async def test_sequences_are_charged_as_slots_or_refused(
    upstream: tuple[StandinReplica, str], store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before, ``n`` and prompt arrays let one slot carry any number of sequences. Under a grant
    a request is charged one slot per sequence: with 3 of 4 slots taken by ``n`` = 3, a request
    with ``n`` = 2 finds no room (503) while one with a single sequence runs. Where a request
    holds one slot (a session's, or any with grants off) more than one is refused, and more than
    any replica's capacity too, each 400 naming the fields."""
    replica, url = upstream
    taking(replica, 2.0, tokens=TOKENS)
    await publish_ready(store, [("r0", url)], capacity=4)
    async with router_client(settings(admission_wait_s=0.3), store_settings) as c:
        three = asyncio.create_task(c.post("/v1/completions", json={**REQ, "n": 3}))
        await generating(replica, 3)
        r = await c.post("/v1/completions", json={**REQ, "prompt": ["a", "b"]})
        assert r.status == 503, await r.text()
        one = await c.post("/v1/completions", json={**REQ, "n": 1})
        assert one.status == 200
        r = await three
        assert r.status == 200
        # n forwarded as asked (a choice per sequence), and nothing else reached the replica
        assert [len((await a.json())["choices"]) for a in (r, one)] == [3, 1]
        assert replica.live_engine().generation_tokens == 4

        gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "n": 5}}
        for path, body, field in [
            ("/v1/completions", {**REQ, "best_of": 9}, "best_of"),
            ("/inference/v1/generate", gen, "sampling_params.n"),
        ]:
            r = await c.post(path, json=body)
            assert r.status == 400, (path, await r.text())
            err = (await r.json())["error"]
            assert (err["code"], err["limit"], err["fields"]) == ("too_many_sequences", 4, [field])
    replica.set_time(TimeModel())  # instant
    async with router_client(settings(grants=False), store_settings) as c:
        sid = (await (await c.post("/v1/rollouts")).json())["rollout_id"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
        for path, body, headers, where, field in [
            ("/v1/completions", {**REQ, "n": 2}, {"X-Rollout-Id": sid}, "session's", "n"),
            ("/v1/chat/completions", chat, {"X-Rollout-Id": sid}, "session's", "n"),
            ("/v1/completions", {**REQ, "prompt": [[1], [2]]}, {}, "grants off", "prompt"),
        ]:
            r = await c.post(path, json=body, headers=headers)
            assert r.status == 400, (path, await r.text())
            err = (await r.json())["error"]
            assert (err["code"], err["sequences"]) == ("one_sequence_per_request", 2)
            assert err["fields"] == [field] and where in err["message"]
        assert (await store.binding(sid)).requests == 0
        assert (await c.post(f"/v1/rollouts/{sid}/close")).status == 200
    await no_leaks(store)
