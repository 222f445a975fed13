"""The strategies benchmark's policy accounting, its EOS markers and its pool client (no
timing)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from rolloutpool.local.models import EOS
from testkit.scenarios.strategies.drivers import PoolTarget
from testkit.scenarios.strategies.models import MARKERS, eos_marker, policy_marker
from testkit.scenarios.strategies.workload import (
    Piece,
    Sample,
    check_markers,
    pieces_of_markers,
    pieces_of_spans,
)
from testkit.standin.weights import load_weights, plan_tokens


def _sample(pieces: list[Piece], bound: int | None = None) -> Sample:
    s = Sample("single", 0.0, 1.0, pieces, step_at_end=2)
    s.bound = bound
    return s


def test_spans_split_the_output_by_policy() -> None:
    m1, m2 = policy_marker(1), policy_marker(2)
    ids = [m1, m1, m2, EOS]
    spans = [{"version": "g1", "start": 0, "end": 2}, {"version": "g2", "start": 2, "end": 4}]
    pieces = pieces_of_spans(ids, spans)
    assert pieces == [Piece(1, (m1, m1)), Piece(2, (m2, EOS))]
    s = _sample(pieces)
    assert s.mixed and s.policy is None and s.tokens == 4
    assert s.cross_generation_tokens == 0


def test_one_span_is_one_policy_and_lag_is_step_minus_policy() -> None:
    m = policy_marker(1)
    s = _sample(pieces_of_spans([m, m, EOS], [{"version": "g1", "start": 0, "end": 3}]))
    assert not s.mixed and s.policy == 1 and s.step_at_end - s.policy == 1


@pytest.mark.parametrize(
    "spans",
    [None, [], [{"version": "g1", "start": 0, "end": 2}], [{"version": "x", "start": 0, "end": 3}]],
)
def test_spans_that_do_not_tile_the_output_are_refused(
    spans: list[dict[str, object]] | None,
) -> None:
    with pytest.raises(ValueError):
        pieces_of_spans([5, 5, 5], spans)


def test_markers_split_the_output_by_policy_without_spans() -> None:
    m1, m2 = policy_marker(1), policy_marker(2)
    pieces = pieces_of_markers([m1, m1, m2, EOS], current=2)
    assert pieces == [Piece(1, (m1, m1)), Piece(2, (m2, EOS))]
    s = _sample(pieces)
    assert s.mixed and s.cross_generation_tokens == 0


def test_markers_name_the_newest_policies_and_eos_alone_goes_to_the_current_one() -> None:
    current = MARKERS + 2  # policy 2's marker is policy MARKERS + 2's: the newest is meant
    assert pieces_of_markers([policy_marker(2), EOS], current) == [
        Piece(current, (policy_marker(2), EOS))
    ]
    assert pieces_of_markers([EOS], current=3) == [Piece(3, (EOS,))]
    assert pieces_of_markers([], current=3) == []


def test_a_token_that_names_no_recent_policy_is_cross_generation() -> None:
    pieces = pieces_of_markers([policy_marker(0), 5, EOS], current=1)
    assert pieces == [Piece(0, (policy_marker(0),)), Piece(1, (5, EOS))]
    assert check_markers(pieces) == 1


def test_a_token_of_another_marker_is_cross_generation() -> None:
    pieces = [Piece(3, (policy_marker(3), policy_marker(4), EOS))]
    assert check_markers(pieces) == 1
    assert _sample(pieces, bound=3).cross_generation_tokens == 1


def test_resubmitted_pieces_of_two_policies_make_a_mixed_sample() -> None:
    s = _sample([Piece(0, (policy_marker(0),)), Piece(1, (policy_marker(1), EOS))])
    assert s.mixed and s.policies == {0, 1}


def test_the_eos_marker_ends_samples_geometrically_on_the_stand_in() -> None:
    p = 1 / 16
    w = load_weights(eos_marker(1, p))
    assert w.marker == policy_marker(1) and w.eos_prob == pytest.approx(p)
    greedy = plan_tokens(w, b"prompt", 0, 64)
    assert greedy == [policy_marker(1)] * 64  # greedy never samples EOS
    lengths = []
    for i in range(400):
        toks = plan_tokens(w, b"prompt", 0, 256, nonce=i.to_bytes(4, "little"))
        assert set(toks) <= {policy_marker(1), EOS}
        lengths.append(toks.index(EOS) + 1 if EOS in toks else 256)
    mean = sum(lengths) / len(lengths)
    assert 12 < mean < 20  # geometric, mean 1/p = 16 (400 draws: sd of the mean about 0.8)


async def test_the_pool_client_sends_a_withheld_session_turn_again() -> None:
    """A session's turn answered 503 ``store_unavailable`` (the router could not confirm the
    binding, so it withheld the output: what a loaded host produced in a clean-clone run) is
    sent again in the same session, as the pool's own clients retry a 503, and counted; before,
    the benchmark's client counted it as an error."""
    calls: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        calls.append(request.headers.get("X-Rollout-Id"))
        if len(calls) == 1:
            return web.json_response({"error": {"code": "store_unavailable"}}, status=503)
        rollout = {"generation": 3, "replica": "r0"}
        return web.json_response({"choices": [{"token_ids": [5, 6]}], "rollout": rollout})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    target = PoolTarget(f"http://127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession() as http:
            ctx = {"session": "ro-s", "generation": 3}
            turn = await target.turn(http, ctx, [1, 2], 4)
    finally:
        await runner.cleanup()
    assert calls == ["ro-s", "ro-s"] and target.retries_503 == 1
    assert turn.pieces == [Piece(3, (5, 6))]
