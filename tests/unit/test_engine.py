"""Error mapping of :class:`pool.engine.VllmEngine` at the httpx seam, on ``httpx.MockTransport``.

These faults (a refused connection at an exact moment, a read timeout on a mutating call, a
``{"success": false}`` cache reset, an old 0.26 server) cannot be produced on demand by the real
CPU vLLM server used in ``tests/integration``, so this module fakes the HTTP layer. Everything
a real server *can* do is tested against a real one in ``tests/integration/test_vllm_cpu.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from pool.engine import Capabilities, VllmEngine, parse_version
from pool.errors import AmbiguousMutation, NoMutation
from tests.helpers import refused_port

Handler = Callable[[httpx.Request], httpx.Response]


def make_engine(handler: Handler, version: str = "0.32.0") -> VllmEngine:
    def wrapped(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": version})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "/m"}]})
        return handler(request)

    return VllmEngine("http://vllm.test", timeout=2.0, transport=httpx.MockTransport(wrapped))


def test_parse_version_and_capabilities() -> None:
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("0.11.1rc2.dev35+gabc") == (0, 11, 1)
    assert parse_version("1.0") == (1, 0, 0)
    with pytest.raises(ValueError):
        parse_version("main")
    old, cpu, new = (Capabilities.from_version(v) for v in ("0.26.0", "0.32.0", "0.33.0"))
    assert (old.labels, old.spans_generate, old.spans_completions, old.paused_503) == (
        False,
        False,
        False,
        False,
    )
    assert (cpu.labels, cpu.spans_generate, cpu.spans_completions, cpu.paused_503) == (
        True,
        True,
        False,
        False,
    )
    assert new.spans_completions and new.paused_503


async def test_connect_error_is_no_mutation_even_for_mutating_calls() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    engine = make_engine(refuse)
    await engine.bootstrap()
    with pytest.raises(NoMutation) as err:
        await engine.collective_rpc("reload_weights", {"weights_path": "/x"})
    assert err.value.context["sent"] is False
    assert err.value.context["path"] == "/collective_rpc"
    assert not isinstance(err.value, AmbiguousMutation)
    assert await engine.health() is False
    await engine.aclose()


async def test_connect_refused_on_a_real_closed_port_is_no_mutation() -> None:
    engine = VllmEngine(f"http://127.0.0.1:{refused_port()}", timeout=2.0)
    with pytest.raises(NoMutation):
        await engine.pause("wait")
    await engine.aclose()


async def test_timeout_on_mutating_call_is_ambiguous_but_on_read_is_no_mutation() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    engine = make_engine(slow)
    await engine.bootstrap()
    with pytest.raises(AmbiguousMutation) as err:
        await engine.pause("wait", timeout_s=0.5)
    assert err.value.context["timed_out"] is True
    assert err.value.context["method"] == "POST"
    with pytest.raises(AmbiguousMutation):
        await engine.collective_rpc("reload_weights", {"weights_path": "/x"})
    with pytest.raises(NoMutation) as err2:
        await engine.is_paused()
    assert not isinstance(err2.value, AmbiguousMutation)
    await engine.aclose()


async def test_deadline_bounds_a_hanging_call() -> None:
    import asyncio
    import time

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, json={})

    engine = VllmEngine("http://vllm.test", transport=httpx.MockTransport(hang))
    t0 = time.monotonic()
    with pytest.raises(AmbiguousMutation):
        await engine.resume(timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    await engine.aclose()


async def test_status_codes_map_by_class_and_carry_context() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause":
            return httpx.Response(400, json={"detail": "bad mode"})
        if request.url.path == "/collective_rpc":
            return httpx.Response(500, json={"error": {"message": "Worker failed"}})
        if request.url.path == "/metrics":
            return httpx.Response(503, text="unavailable")
        return httpx.Response(404)

    engine = make_engine(answer)
    await engine.bootstrap()
    with pytest.raises(NoMutation) as e400:
        await engine.pause("wait")
    assert e400.value.context["status"] == 400 and "bad mode" in e400.value.context["body"]
    with pytest.raises(AmbiguousMutation) as e500:
        await engine.collective_rpc("reload_weights", {"weights_path": "/x"})
    assert e500.value.context["status"] == 500
    assert "Worker failed" in e500.value.context["body"]
    assert "Worker failed" in str(e500.value)
    with pytest.raises(NoMutation) as e503:  # read-only: a 5xx proves nothing changed
        await engine.metrics()
    assert not isinstance(e503.value, AmbiguousMutation)
    await engine.aclose()


async def test_reset_success_false_is_retried_then_reported_not_raised() -> None:
    calls: dict[str, int] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        calls[path] = calls.get(path, 0) + 1
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": False})
        return httpx.Response(200)  # mm/encoder resets: empty 200

    engine = make_engine(answer)
    await engine.bootstrap()
    ev = await engine.reset_caches(retries=3, backoff_s=0.01)
    assert calls["/reset_prefix_cache"] == 3
    assert ev.prefix is False and ev.attempts == 3 and not ev.proves_reset
    assert "success=false" in ev.detail
    assert calls["/reset_mm_cache"] == 1 and calls["/reset_encoder_cache"] == 1
    await engine.aclose()


async def test_reset_succeeds_after_transient_false() -> None:
    answers = iter([False, False, True])

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": next(answers)})
        return httpx.Response(200)

    engine = make_engine(answer)
    await engine.bootstrap()
    ev = await engine.reset_caches(retries=5, backoff_s=0.01)
    assert ev.proves_reset and ev.attempts == 3
    await engine.aclose()


async def test_a_reset_refused_while_another_ran_is_ambiguous() -> None:
    """The three resets go out at once: the mm reset never reached the server while the
    prefix and encoder resets ran, so the caches are neither untouched nor reset."""
    ran: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reset_mm_cache":
            raise httpx.ConnectError("refused", request=request)
        ran.append(request.url.path)
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200)

    engine = make_engine(answer)
    await engine.bootstrap()
    with pytest.raises(AmbiguousMutation, match="partly done") as e:
        await engine.reset_caches(retries=1)
    assert e.value.context.get("partial") is True
    assert sorted(ran) == ["/reset_encoder_cache", "/reset_prefix_cache"]
    await engine.aclose()


async def test_reset_body_without_success_is_ambiguous() -> None:
    engine = make_engine(lambda r: httpx.Response(200, text="OK"))
    await engine.bootstrap()
    with pytest.raises(AmbiguousMutation):
        await engine.reset_caches(retries=1)
    await engine.aclose()


async def test_labels_unsupported_on_0_26_without_any_call() -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(404)

    engine = make_engine(answer, version="0.26.0")
    caps = await engine.bootstrap()
    assert caps.labels is False and caps.spans_generate is False
    label = await engine.weight_label()
    assert (label.supported, label.label) == (False, None)
    assert (await engine.set_label("g1")).supported is False
    assert seen == []
    await engine.aclose()


async def test_set_label_checks_success_field() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"success": False, "new_version": "g1"})

    engine = make_engine(answer)
    await engine.bootstrap()
    with pytest.raises(NoMutation):
        await engine.set_label("g1")
    await engine.aclose()


async def test_metrics_sum_over_label_sets() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 12.0',
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9',
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0',
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            "",
        ]
    )
    engine = make_engine(lambda r: httpx.Response(200, text=text))
    m = await engine.metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (312, 256)
    assert (m.requests_running, m.requests_waiting) == (3, 0)
    await engine.aclose()


async def test_capabilities_before_bootstrap_is_a_programming_error() -> None:
    engine = make_engine(lambda r: httpx.Response(200))
    with pytest.raises(RuntimeError, match="bootstrap"):
        await engine.weight_label()
    await engine.aclose()


async def test_the_process_identity_is_read_from_one_metric_then_the_whole_scrape() -> None:
    """vLLM's /metrics honours prometheus_client's name[] filter (one metric instead of the
    whole scrape); where the filtered answer lacks the start time, the full scrape is read."""
    asked: list[str] = []
    filtered_has_it = True

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/metrics":
            return httpx.Response(200, json={"is_paused": False})
        name = request.url.params.get("name[]")
        asked.append(name or "all")
        line = "process_start_time_seconds 1700000000.25\n"
        if name is not None and not filtered_has_it:
            return httpx.Response(200, text="")
        return httpx.Response(200, text=line if name else "vllm:x 1\n" + line)

    engine = make_engine(answer)
    assert await engine.process_identity() == "api-server-started:1700000000.25"
    assert asked == ["process_start_time_seconds"]
    filtered_has_it = False
    ev = await engine.confirm_resumed()
    assert ev.process == "api-server-started:1700000000.25" and ev.is_paused is False
    assert asked[1:] == ["process_start_time_seconds", "all"]
    await engine.aclose()
