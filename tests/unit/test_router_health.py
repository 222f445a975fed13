"""The router's passive health (:mod:`router.health`): a replica whose process is gone while the
store still says READY (no updater alive to taint it) stops costing a 502 per rollout. The
HTTP test runs a router on a real Redis with one live stand-in replica (conformance-tested
against vLLM CPU) and one READY record whose port has no server."""

from __future__ import annotations

from collections import Counter

from pool.settings import StoreSettings
from pool.store import RedisStore
from rolloutpool.local.models import ensure_model
from router.health import PassiveHealth
from router.settings import RouterSettings
from testkit.harness import publish_ready, router_client
from testkit.standin import ReplicaConfig, StandinFleet
from tests.helpers import refused_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_consecutive_failures_eject_until_a_trial_answers() -> None:
    clock = Clock()
    h = PassiveHealth(failures=3, backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    for _ in range(2):
        h.failed("http://a")
    assert h.admits("http://a")  # two failures in a row: still chosen
    h.failed("http://a")
    assert not h.admits("http://a") and h.ejected() == ["http://a"]
    assert h.admits("http://b")  # others are untouched
    clock.now += 1.0
    assert h.admits("http://a")  # half-open: one trial...
    assert not h.admits("http://a")  # ...and only one
    h.failed("http://a")  # the trial failed: ejected for twice as long
    clock.now += 1.5
    assert not h.admits("http://a")
    clock.now += 0.5
    assert h.admits("http://a")
    h.answered("http://a")
    assert h.admits("http://a") and h.admits("http://a") and h.ejected() == []


def test_an_answer_between_failures_resets_the_count() -> None:
    h = PassiveHealth(failures=2, clock=Clock())
    h.failed("http://a")
    h.answered("http://a")
    h.failed("http://a")
    assert h.admits("http://a")


async def test_a_dead_ready_replica_stops_costing_502s(
    store_settings: StoreSettings, store: RedisStore
) -> None:
    """Before: with no updater alive, every rollout the router sent to the dead replica's READY
    record answered 502 (~3,350 in a fault run). Now at most ``failures`` do."""
    model = ensure_model("random", seed=1)
    async with StandinFleet() as fleet:
        (live,) = await fleet.add_many([ReplicaConfig(model=model, served_model_name="m")])
        dead = f"http://127.0.0.1:{refused_port()}"
        await publish_ready(store, [("r-live", live.url), ("r-dead", dead)])
        settings = RouterSettings(admission_wait_s=2.0)
        statuses: Counter[int] = Counter()
        async with router_client(settings, store_settings) as c:
            for i in range(40):
                body = {"model": "m", "prompt": [5, 6, i], "max_tokens": 2}
                r = await c.post("/v1/completions", json=body)
                statuses[r.status] += 1
        assert statuses[502] <= 3, statuses
        assert statuses[200] == 40 - statuses[502], statuses
