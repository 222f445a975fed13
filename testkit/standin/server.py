"""The HTTP side of stand-in replicas: one aiohttp application serves every replica of the
process, one listening socket per replica; a request's local port selects its replica.

Routes (the subset of vLLM 0.32's API that RolloutPool uses, plus the trivial neighbours):
``GET /health /version /v1/models /metrics /load /is_paused /weight_info /get_world_size``,
``POST /pause /resume /abort_requests /reset_prefix_cache /reset_mm_cache /reset_encoder_cache
/collective_rpc /update_weight_version`` (the NCCL weight-transfer routes answer as on a CPU
server without a transfer backend), and ``POST /v1/completions /v1/chat/completions
/inference/v1/generate`` (:mod:`testkit.standin.inference`).

Like vLLM's engine core, the control calls that reach the engine (pause, resume, is_paused, the
cache resets, labels, ``collective_rpc``, ``abort_requests``) run one at a time
(:attr:`StandinReplica.utility`); a weight transfer holds that turn for
``TimeModel.transfer_s``, and forever with the ``stuck_transfer`` fault, so they then hang as on
a real server whose workers are stuck in a collective. ``/health`` and ``/metrics`` never wait
for it. Version-dependent behaviour follows ``ReplicaConfig.version``: labels from 0.27,
``weight_versions`` on ``/inference/v1/generate`` from 0.32, on completions (with
``return_weight_versions``) and 503 for requests sent while paused (``abort``/``wait``) from 0.33.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pool.engine import parse_version
from testkit.standin.engine import EngineDead, PauseMode, SimEngine, TimeModel
from testkit.standin.protocol import (
    ApiError,
    dumps,
    error,
    http_error,
    validation_error,
)
from testkit.standin.weights import Tokenizer, WeightsError, load_weights

__all__ = ["REPLICA", "Faults", "ReplicaConfig", "StandinReplica", "create_app"]


class Faults(BaseModel):
    """Fault switches of one replica; replace :attr:`StandinReplica.faults` to change them.

    ``hang``: every request is accepted and never answered; ``hang_paths``: the same for these
    paths only; ``slow_health_s``: ``/health`` answers after that many seconds;
    ``stuck_transfer``: ``reload_weights`` never returns and holds the engine's utility turn
    (pause, resume, ``is_paused``... hang too; ``/health`` stays 200); ``fail_reload``:
    ``reload_weights`` fails with a 500 and leaves the engine poisoned, as a missing path does on
    vLLM: the next generation request kills the replica unless a good reload comes first. Dying
    and restarting are actions: :meth:`StandinReplica.die`, :meth:`StandinReplica.restart`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hang: bool = False
    hang_paths: frozenset[str] = frozenset()
    slow_health_s: float = Field(default=0.0, ge=0)
    stuck_transfer: bool = False
    fail_reload: bool = False


class ReplicaConfig(BaseModel):
    """What one stand-in replica serves and how. ``port`` 0 picks a free port."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    served_model_name: str | None = None
    version: str = "0.32.0"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    max_model_len: int = Field(default=512, gt=0)
    max_running: int = Field(default=256, gt=0)
    block_size: int = Field(default=128, gt=0)
    cache_blocks: int = Field(default=256, gt=0)
    #: a Jinja chat template; ``None``: the one in the model's tokenizer_config.json, if any
    chat_template: str | None = None
    time: TimeModel = TimeModel()

    @property
    def model_name(self) -> str:
        """The name requests must use in ``"model"`` (vLLM defaults it to the model path)."""
        return self.served_model_name or str(self.model.expanduser().resolve())


REPLICA: web.AppKey[dict[int, StandinReplica]] = web.AppKey("standin_replicas", dict)


class StandinReplica:
    """One replica: its config, faults, engine (``None`` while dead) and listening socket.

    Created by :class:`testkit.standin.StandinFleet`. :meth:`die` and :meth:`restart` may be
    called from any task of the fleet's event loop.
    """

    def __init__(self, config: ReplicaConfig, runner: web.AppRunner, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.faults = Faults()
        self.time = config.time
        self.model = config.model.expanduser().resolve()
        self.tokenizer = Tokenizer.of(self.model)
        self.chat_template = config.chat_template or _template_of(self.model)
        self.caps = parse_version(config.version)
        self.fingerprint = f"vllm-{config.version}-" + _short(config.model_name)
        self.engine: SimEngine | None = None
        self.utility = asyncio.Lock()
        self.poisoned = False
        self.in_flight = 0
        self.started_at = time.time()
        self._runner = runner
        self._site: web.SockSite | None = None
        self._sock = _bind(config.host, config.port)
        self.port: int = self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._site is not None

    @property
    def labels(self) -> bool:
        return self.caps >= (0, 27, 0)

    def set_time(self, model: TimeModel) -> None:
        """Change the time model now (running requests continue at the new rates)."""
        self.time = model
        if self.engine is not None:
            self.engine.time = model
            self.engine.update()

    async def start(self, model: Path | None = None) -> None:
        """Load ``model`` (default: the configured one), wait ``startup_s``, then listen.

        Until then the port is bound but not listening: connections are refused.
        """
        if self._site is not None:
            raise RuntimeError(f"{self.url} is already serving")
        weights = await asyncio.to_thread(load_weights, model or self.model)
        await asyncio.sleep(self.time.startup_s)
        self.engine = SimEngine(
            weights,
            time=self.time,
            max_running=self.config.max_running,
            block_size=self.config.block_size,
            cache_blocks=self.config.cache_blocks,
        )
        self.poisoned = False
        self.utility = asyncio.Lock()
        self.started_at = time.time()
        self._runner.app[REPLICA][self.port] = self
        site = web.SockSite(self._runner, self._sock)
        await site.start()
        self._site = site

    async def die(self) -> None:
        """Stop listening and reset every open connection; in-flight requests get no answer."""
        site, self._site = self._site, None
        if self.engine is not None:
            self.engine.kill()
            self.engine = None
        if site is not None:
            await site.stop()
        server = self._runner.server
        if server is not None:
            for handler in server.connections:
                transport = handler.transport
                sock = None if transport is None else transport.get_extra_info("socket")
                if sock is not None and sock.getsockname()[1] == self.port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    transport.abort()  # type: ignore[union-attr]
        self._sock = _bind(self.config.host, self.port)

    async def restart(self, model: Path | None = None) -> None:
        """A fresh process: :meth:`die` if alive, then :meth:`start` (label ``default``, empty
        caches, ``model`` or the configured checkpoint loaded, faults cleared)."""
        if self.alive:
            await self.die()
        self.faults = Faults()
        await self.start(model)

    def close_socket(self) -> None:
        """Release the port for good (after :meth:`die`; the replica cannot start again)."""
        self._sock.close()

    def status(self) -> dict[str, Any]:
        e = self.engine
        return {
            "index": self.index,
            "url": self.url,
            "alive": self.alive,
            "model": self.config.model_name,
            "weights": None if e is None else str(e.weights.path),
            "label": None if e is None else e.label,
            "paused": None if e is None else e.pause_mode,
            "running": 0 if e is None else len(e.running),
            "waiting": 0 if e is None else len(e.waiting),
            "faults": self.faults.model_dump(mode="json"),
            "time": self.time.model_dump(),
        }

    def live_engine(self) -> SimEngine:
        if self.engine is None:
            raise EngineDead(f"{self.url} is dead")
        return self.engine


SERVING = web.RequestKey("standin_replica", StandinReplica)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _short(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def _template_of(model: Path) -> str | None:
    try:
        config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


# ------------------------------------------------------------------------------ middleware


def replica_of(request: web.Request) -> StandinReplica:
    return request[SERVING]


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as e:
        response = ok(e.body, e.status)
        if e.status >= 500:
            response.force_close()  # uvicorn drops the connection after a 500
        return response
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
        return ok({"detail": e.reason}, e.status)
    except EngineDead:
        return await drop(request)


async def drop(request: web.Request) -> web.StreamResponse:
    """Reset the connection and never answer (the handler is cancelled by the disconnect)."""
    transport = request.transport
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if transport is not None:
        transport.abort()
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@web.middleware
async def _dispatch(request: web.Request, handler: Any) -> web.StreamResponse:
    transport = request.transport
    sockname = None if transport is None else transport.get_extra_info("sockname")
    replica = request.app[REPLICA].get(sockname[1]) if sockname else None
    if replica is None or not replica.alive:
        return await drop(request)  # a replica that died under this connection
    request[SERVING] = replica
    faults = replica.faults
    if faults.hang or request.path in faults.hang_paths:
        await asyncio.Event().wait()  # accepted, never answered (until the client gives up)
    if request.path == "/health" and faults.slow_health_s:
        await asyncio.sleep(faults.slow_health_s)
    response: web.StreamResponse = await handler(request)
    return response


def create_app() -> web.Application:
    """The application every replica of a fleet shares (served with handler cancellation)."""
    from testkit.standin import inference

    app = web.Application(middlewares=[_errors, _dispatch], client_max_size=64 << 20)
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


def ok(body: Any, status: int = 200) -> web.Response:
    """A JSON answer with vLLM's exact ``Content-Type`` (no charset parameter)."""
    return web.Response(body=dumps(body).encode(), status=status, headers=_JSON)


_JSON = {"Content-Type": "application/json"}


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
        "id": f"modelperm-{_short(str(now) + rep.url)}{_short(rep.url)}",
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
    return web.Response(
        text="\n".join(lines) + "\n",
        headers={"Content-Type": "text/plain; version=1.0.0; charset=utf-8"},
    )


async def load(request: web.Request) -> web.Response:
    return ok({"server_load": replica_of(request).in_flight})


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


def generation_engine(rep: StandinReplica) -> SimEngine:
    """The engine a generation request runs on; a poisoned replica dies now (as vLLM's worker
    does on the first request after a failed reload) and the request is answered by no one."""
    engine = rep.live_engine()
    if rep.poisoned:
        asyncio.get_running_loop().create_task(rep.die())
        raise EngineDead(f"{rep.url}: the worker died on its first request after a failed reload")
    return engine


Kind = Literal["completion", "chat", "generate"]
