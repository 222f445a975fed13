"""The stand-in's simulated engine alone (no HTTP), on a fake clock: the time model, pause modes,
labels and spans, the prefix cache and its stale-KV model, weights and the probe helper.

Time is driven by hand (``clock.t = ...; engine.update()``), so every assertion is exact.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rolloutpool.local.models import ensure_model, marker_token
from testkit.standin.engine import EngineDead, SimEngine, SimRequest, TimeModel
from testkit.standin.weights import Weights, expected_tokens, load_weights

PROMPT = [0, *range(300, 316)]
LONG = [0, *[(i * 37) % 1700 + 300 for i in range(299)]]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def a() -> Weights:
    return load_weights(ensure_model("random", seed=1))


@pytest.fixture(scope="module")
def b() -> Weights:
    return load_weights(ensure_model("random", seed=2))


@pytest.fixture(scope="module")
def marker() -> Weights:
    return load_weights(ensure_model("marker", token_id=marker_token(1)))


def engine(w: Weights, clock: Clock, **time: float) -> SimEngine:
    return SimEngine(w, time=TimeModel(**time), clock=clock)


def req(n: int = 100, prompt: list[int] = PROMPT, **kw: object) -> SimRequest:
    return SimRequest("r", prompt, n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_weights_identity_marker_and_probe(a: Weights, b: Weights, marker: Weights) -> None:
    assert a.marker is None and b.marker is None and a.identity != b.identity
    assert marker.marker == marker_token(1)
    assert (a.vocab_size, a.eos_token_id) == (2048, 1)
    out_a = expected_tokens(a.path, PROMPT, 16)
    assert out_a == expected_tokens(a.path, PROMPT, 16) != expected_tokens(b.path, PROMPT, 16)
    assert expected_tokens(a.path, PROMPT, 8) == out_a[:8]
    assert expected_tokens(marker.path, PROMPT, 5) == (marker_token(1),) * 5


async def test_rate_per_request_and_per_replica(a: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    r = req(100)
    e.submit([r])
    clock.t = 0.5
    e.update()
    assert len(r.tokens) == 50 and not r.done
    clock.t = 1.0
    e.update()
    assert r.finish_reason == "length" and r.tokens == list(expected_tokens(a.path, PROMPT, 100))

    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100, replica_tokens_per_s=100)
    r1, r2 = req(100), req(100)
    e.submit([r1, r2])
    clock.t = 1.0
    e.update()
    assert (len(r1.tokens), len(r2.tokens)) == (50, 50)  # the replica's rate is shared
    e.abort([r2])
    clock.t = 1.5
    e.update()
    assert len(r1.tokens) == 100 and r1.done  # alone again: the per-request cap applies

    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=10)
    r = req(100)
    e.submit([r])
    clock.t = 1.0
    e.set_time(TimeModel(request_tokens_per_s=100))  # the first second still ran at 10/s
    clock.t = 1.5
    e.update()
    assert len(r.tokens) == 60


async def test_instant_model_and_max_running(a: Weights) -> None:
    e = SimEngine(a)
    r = req(300)
    e.submit([r])
    assert r.finish_reason == "length" and len(r.tokens) == 300
    clock = Clock()
    e = SimEngine(a, time=TimeModel(request_tokens_per_s=10), clock=clock, max_running=2)
    rs = [req(10) for _ in range(3)]
    e.submit(rs)
    assert e.gauges == (2, 1) and rs[2].tokens == []
    clock.t = 1.0
    e.update()
    assert rs[0].done and rs[1].done and not rs[2].done and e.gauges == (1, 0)


async def test_eos_ends_a_request_unless_ignored(a: Weights) -> None:
    prompt = next([i] for i in range(3, 500) if a.eos_token_id in expected_tokens(a.path, [i], 300))
    k = expected_tokens(a.path, prompt, 300).index(1) + 1
    e = SimEngine(a)
    stop, ignored = SimRequest("s", prompt, 300), SimRequest("i", prompt, 300, ignore_eos=True)
    e.submit([stop, ignored])
    assert stop.finish_reason == "stop" and len(stop.tokens) == k and stop.tokens[-1] == 1
    assert ignored.finish_reason == "length" and len(ignored.tokens) == 300
    assert expected_tokens(a.path, prompt, 300, ignore_eos=False) == tuple(stop.tokens)


async def test_pause_keep_freezes_and_label_change_opens_a_span(a: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    r = req(100)
    e.submit([r])
    clock.t = 0.3
    pause = e.pause("keep", clear_cache=True)
    await asyncio.sleep(0)
    assert pause.done() and e.paused and e.gauges == (1, 0)
    clock.t = 5.0
    e.update()
    assert len(r.tokens) == 30  # frozen
    e.set_label("g1")
    late = req(5)
    e.submit([late])
    assert late.tokens == [] and e.gauges == (1, 0)  # queued, gauges frozen
    e.resume()
    clock.t = 5.7
    e.update()
    assert r.done and r.spans == [["default", 0, 30], ["g1", 30, 100]]
    assert late.done and late.spans == [["g1", 0, 5]]
    assert e.preemptions == 1  # clear_cache preempted the frozen request


async def test_pause_wait_drains_then_queues_and_abort_ends_all(a: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    running = req(50)
    e.submit([running])
    pause = e.pause("wait", clear_cache=False)
    queued = req(10)
    e.submit([queued])
    clock.t = 0.4
    e.update()
    assert not pause.done() and len(running.tokens) == 40 and queued.tokens == []
    clock.t = 0.5
    e.update()
    await asyncio.sleep(0)
    assert pause.done() and running.finish_reason == "length" and queued.tokens == []
    clock.t = 1.0
    e.update()
    assert queued.tokens == []  # still paused
    abort = e.pause("abort", clear_cache=True)
    await asyncio.sleep(0)
    assert abort.done() and queued.finish_reason == "abort" and queued.tokens == []


async def test_reset_prefix_cache_refused_while_blocks_are_held(a: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    r = req(100)
    e.submit([r])
    assert e.reset_prefix_cache() is False
    assert e.reset_prefix_cache(reset_running_requests=True) is True
    e.pause("keep", clear_cache=False)
    assert e.reset_prefix_cache() is False  # frozen but still holding its blocks
    e.resume()
    clock.t = 2.0
    e.update()
    assert r.finish_reason == "length" and e.reset_prefix_cache() is True


async def test_prefix_cache_hits_salts_and_stale_kv(a: Weights, b: Weights) -> None:
    e = SimEngine(a)

    def run(salt: str | None = None) -> tuple[list[int], int]:
        hits = e.prefix_hits
        r = SimRequest("x", LONG, 8, ignore_eos=True, salt=salt)
        e.submit([r])
        return r.tokens, e.prefix_hits - hits

    assert [run()[1], run()[1], run("s")[1], run("s")[1]] == [0, 256, 0, 256]
    assert e.prefix_queries == 4 * len(LONG)
    e.swap_weights(b)  # no reset: A's blocks remain
    stale, hits = run()
    assert hits == 256 and stale != list(expected_tokens(b.path, LONG, 8))
    assert e.reset_prefix_cache()
    fresh, hits = run()
    assert hits == 0 and fresh == list(expected_tokens(b.path, LONG, 8))
    assert run() == (fresh, 256)  # B's own blocks: B's output


async def test_reload_mid_request_switches_marker(a: Weights, marker: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    r = req(20)
    e.submit([r])
    clock.t = 0.1
    e.pause("keep", clear_cache=False)
    e.block()
    e.swap_weights(marker)
    e.unblock()
    e.resume()
    clock.t = 1.0
    e.update()
    assert r.tokens[:10] == list(expected_tokens(a.path, PROMPT, 10))
    assert r.tokens[10:] == [marker.marker] * 10  # mixed: what the pool must never admit


async def test_blocked_engine_makes_no_progress_and_kill(a: Weights) -> None:
    clock = Clock()
    e = engine(a, clock, request_tokens_per_s=100)
    r = req(100)
    e.submit([r])
    e.block()
    clock.t = 10.0
    e.update()
    assert r.tokens == []
    e.unblock()
    clock.t = 10.2
    e.update()
    assert len(r.tokens) == 20
    e.kill()
    assert r.dead and r.done and r.changed.is_set()
    with pytest.raises(EngineDead):
        e.submit([req(1)])


def test_load_weights_rejects_a_non_checkpoint(tmp_path: Path) -> None:
    from testkit.standin.weights import WeightsError

    with pytest.raises(WeightsError):
        load_weights(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError):
        load_weights(tmp_path)
