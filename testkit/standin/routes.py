"""The non-inference routes of a stand-in replica, and the application that serves them all.

Simple routes: ``GET /health /version /v1/models /metrics /load /get_world_size``. Control
routes: ``GET /is_paused /weight_info``, ``POST /pause /resume /abort_requests
/reset_prefix_cache /reset_mm_cache /reset_encoder_cache /collective_rpc
/update_weight_version``; the NCCL weight-transfer routes answer as on a CPU server without a
transfer backend (500 "Weight transfer not configured"; shutdown 200). Bodies and errors are
vLLM 0.32's (pinned by ``tests/integration/test_standin_conformance.py``).

Like vLLM's engine core, the control calls that reach the engine run one at a time
(:attr:`~testkit.standin.server.StandinReplica.utility`). ``reload_weights`` holds that turn
for ``TimeModel.transfer_s`` (forever with the ``stuck_transfer`` fault) and keeps running when
its HTTP client gives up, as an engine-side RPC does; ``/health`` and ``/metrics`` never wait.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from testkit.standin import inference
from testkit.standin.engine import EngineDead, PauseMode, SimEngine
from testkit.standin.protocol import ApiError, error, http_error, validation_error
from testkit.standin.server import MIDDLEWARES, REPLICA, StandinReplica, ok, replica_of, short
from testkit.standin.weights import WeightsError, load_weights

__all__ = ["create_app"]


def create_app() -> web.Application:
    """The application every replica of a fleet shares (served with handler cancellation)."""
    app = web.Application(middlewares=MIDDLEWARES, client_max_size=64 << 20)
    app[REPLICA] = {}
    get, post = app.router.add_get, app.router.add_post
    get("/health", health, allow_head=False)
    get("/version", version, allow_head=False)
    get("/v1/models", models, allow_head=False)
    get("/metrics", metrics, allow_head=False)
    get("/load", load, allow_head=False)
    get("/is_paused", is_paused, allow_head=False)
    get("/weight_info", weight_info, allow_head=False)
    get("/get_world_size", world_size, allow_head=False)
    post("/pause", pause)
    post("/resume", resume)
    post("/abort_requests", abort_requests)
    post("/reset_prefix_cache", reset_prefix_cache)
    post("/reset_mm_cache", empty_ok)
    post("/reset_encoder_cache", empty_ok)
    post("/collective_rpc", collective_rpc)
    post("/update_weight_version", update_weight_version)
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights"):
        post(path, no_weight_transfer)
    post("/finish_weight_update", no_weight_transfer)
    post("/shutdown_weight_transfer_engine", shutdown_weight_transfer)
    post("/v1/completions", inference.completions)
    post("/v1/chat/completions", inference.chat_completions)
    post("/inference/v1/generate", inference.generate)
    return app


# ------------------------------------------------------------------------------ simple routes


async def health(request: web.Request) -> web.Response:
    replica_of(request).live_engine()
    return web.Response()


async def version(request: web.Request) -> web.Response:
    return ok({"version": replica_of(request).config.version})


async def models(request: web.Request) -> web.Response:
    rep = replica_of(request)
    now = int(time.time())
    permission = {
        "id": f"modelperm-{short(str(now) + rep.url)}{short(rep.url)}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": rep.config.model_name,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": str(rep.model),
        "parent": None,
        "max_model_len": rep.config.max_model_len,
        "permission": [permission],
    }
    return ok({"object": "list", "data": [card]})


_METRICS = (
    ("num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("prefix_cache_queries", "counter",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    ("prompt_tokens", "counter", "Number of prefill tokens processed."),
    ("generation_tokens", "counter", "Number of generation tokens processed."),
    ("num_preemptions", "counter", "Cumulative number of preemption from the engine."),
)  # fmt: skip


async def metrics(request: web.Request) -> web.Response:
    rep = replica_of(request)
    e = rep.live_engine()
    values = (
        *e.gauges,
        e.prefix_queries,
        e.prefix_hits,
        e.prompt_tokens,
        e.generation_tokens,
        e.preemptions,
    )
    labels = '{engine="0",model_name="' + rep.config.model_name.replace('"', '\\"') + '"}'
    lines = []
    for (name, kind, doc), value in zip(_METRICS, values, strict=True):
        full = f"vllm:{name}_total" if kind == "counter" else f"vllm:{name}"
        lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}", f"{full}{labels} {value:.1f}"]
    lines += [
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {rep.started_at:.2f}",
    ]
    return web.Response(
        text="\n".join(lines) + "\n",
        headers={"Content-Type": "text/plain; version=1.0.0; charset=utf-8"},
    )


async def load(request: web.Request) -> web.Response:
    return ok({"server_load": 0})  # vLLM without --enable-server-load-tracking


async def world_size(request: web.Request) -> web.Response:
    _query_bool(request, "include_dp", True)
    return ok({"world_size": 1})


async def empty_ok(request: web.Request) -> web.Response:
    rep = replica_of(request)
    async with rep.utility:
        rep.live_engine()
    return web.Response()


async def no_weight_transfer(request: web.Request) -> web.Response:
    raise error(
        500,
        "Call to collective_rpc method failed: Worker failed with error 'Weight transfer not "
        "configured. Please set weight_transfer_config to enable weight transfer.', please "
        "check the stack trace above for the root cause",
        "InternalServerError",
    )


async def shutdown_weight_transfer(request: web.Request) -> web.Response:
    return ok({"message": "Weight transfer shut down"})


# ------------------------------------------------------------------------------ control routes


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "t", "yes", "y", "on"):
        return True
    if value in ("0", "false", "f", "no", "n", "off"):
        return False
    item = {
        "type": "bool_parsing",
        "loc": f"query.{name}",
        "msg": "Input should be a valid boolean, unable to interpret input",
        "input": raw,
    }
    raise error(400, f"1 validation error:\n  {item}", "Bad Request", f"query.{name}")


_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


async def pause(request: web.Request) -> web.Response:
    rep = replica_of(request)
    raw = request.query.get("mode", "abort")
    if raw not in _MODES:
        item = {
            "type": "literal_error",
            "loc": "query.mode",
            "msg": "Input should be 'abort', 'wait' or 'keep'",
            "input": raw,
            "ctx": {"expected": "'abort', 'wait' or 'keep'"},
        }
        raise error(400, f"1 validation error:\n  {item}", "Bad Request", "query.mode")
    mode: PauseMode = raw
    clear_cache = _query_bool(request, "clear_cache", True)
    async with rep.utility:
        done = rep.live_engine().pause(mode, clear_cache)
    try:
        await done
    except EngineDead as e:
        raise error(500, f"Failed to pause generation: {e}", "InternalServerError") from e
    return ok({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    rep = replica_of(request)
    async with rep.utility:
        rep.live_engine().resume()
    return ok({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    rep = replica_of(request)
    async with rep.utility:
        return ok({"is_paused": rep.live_engine().paused})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    rep = replica_of(request)
    running = _query_bool(request, "reset_running_requests", False)
    _query_bool(request, "reset_external", False)
    async with rep.utility:
        return ok({"success": rep.live_engine().reset_prefix_cache(running)})


async def _json_body(request: web.Request, not_json: str) -> dict[str, Any]:
    """The JSON object body of a control route, with vLLM's ``HTTPException`` 400s."""
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        raise http_error(400, not_json.format(e=e)) from e
    if not isinstance(body, dict):
        raise http_error(400, "Request body must be a JSON object")
    return body


async def abort_requests(request: web.Request) -> web.Response:
    rep = replica_of(request)
    body = await _json_body(request, "Invalid JSON format")
    ids = body.get("request_ids")
    async with rep.utility:
        engine = rep.live_engine()
        if ids:
            wanted = {str(i) for i in ids}
            engine.abort(r for r in [*engine.running, *engine.waiting] if r.request_id in wanted)
            count = len(ids)
        else:
            count = engine.abort_all()
    return ok({"status": "aborted", "aborted": count})


class _NewVersion(BaseModel):
    new_version: str


async def update_weight_version(request: web.Request) -> web.Response:
    rep = replica_of(request)
    if not rep.labels:
        raise web.HTTPNotFound()
    try:
        raw = json.loads(await request.read() or b"null")
        body = _NewVersion.model_validate(raw if isinstance(raw, dict) else {})
    except ValueError as e:
        if isinstance(e, ValidationError):
            raise validation_error(e) from e
        raise http_error(400, f"JSON decode error: {e}") from e
    async with rep.utility:
        rep.live_engine().set_label(body.new_version)
    return ok({"success": True, "new_version": body.new_version})


async def weight_info(request: web.Request) -> web.Response:
    rep = replica_of(request)
    if not rep.labels:
        raise web.HTTPNotFound()
    async with rep.utility:
        return ok({"weight_version": rep.live_engine().label})


def _rpc_failed(detail: str) -> ApiError:
    return error(
        500,
        f"Call to collective_rpc method failed: Worker failed with error '{detail}', please "
        "check the stack trace above for the root cause",
        "InternalServerError",
    )


async def collective_rpc(request: web.Request) -> web.Response:
    """``reload_weights`` (``kwargs.weights_path``, default: the current checkpoint) is the one
    worker method modelled; any other fails like a missing attribute of vLLM's CPU worker."""
    rep = replica_of(request)
    body = await _json_body(request, "JSON decode error: {e}")
    method = body.get("method")
    if method is None:
        raise http_error(400, "Missing 'method' in request body")
    if method != "reload_weights":
        raise _rpc_failed(f"'CPUWorker' object has no attribute '{method}'")
    kwargs = body.get("kwargs") or {}
    # The RPC runs in the engine whatever happens to this HTTP call (a client that gives up
    # does not stop a transfer), so it is a task of its own.
    await asyncio.shield(asyncio.ensure_future(_reload(rep, kwargs.get("weights_path"))))
    return ok({"results": [None]})


async def _reload(rep: StandinReplica, weights_path: Any) -> None:
    async with rep.utility:
        engine = rep.live_engine()
        engine.block()
        try:
            await _transfer(rep, engine, Path(str(weights_path or engine.weights.path)))
        finally:
            engine.unblock()


async def _transfer(rep: StandinReplica, engine: SimEngine, path: Path) -> None:
    if rep.faults.stuck_transfer:
        await asyncio.Event().wait()
    await asyncio.sleep(rep.time.transfer_s)
    try:
        if rep.faults.fail_reload:
            raise WeightsError(f"injected reload failure for {path}")
        weights = await asyncio.to_thread(load_weights, path)
    except WeightsError as e:
        rep.poisoned = True  # vLLM is left with meta tensors: the next request kills it
        raise _rpc_failed(
            f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
            f"Use `repo_type` argument if needed. ({e.message})"
        ) from e
    rep.poisoned = False
    engine.swap_weights(weights)
