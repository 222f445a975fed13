"""Stand-in replicas: their configuration, faults, lifecycle, and the HTTP plumbing they share.

One aiohttp application serves every replica of the process (:func:`testkit.standin.routes.
create_app`), one listening socket per replica; a request's local port selects its replica
(:data:`MIDDLEWARES`), which also applies the replica's :class:`Faults`. A replica that dies
stops listening and resets its open connections; one restarted is a fresh process (weights
reloaded from disk, label ``default``, empty caches). Version-dependent behaviour follows
``ReplicaConfig.version``: labels from 0.27, ``weight_versions`` on ``/inference/v1/generate``
from 0.32, on completions (with ``return_weight_versions``) and 503 for requests sent while
paused (``abort``/``wait``) from 0.33.
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
from pydantic import BaseModel, ConfigDict, Field

from pool.engine import parse_version
from testkit.standin.engine import EngineDead, SimEngine, TimeModel
from testkit.standin.protocol import ApiError, dumps
from testkit.standin.weights import Tokenizer, load_weights

__all__ = [
    "MIDDLEWARES",
    "REPLICA",
    "Faults",
    "InferenceFailure",
    "ReplicaConfig",
    "StandinReplica",
]


class InferenceFailure(BaseModel):
    """The error answer of the ``fail_inference`` fault: vLLM's error body with this status."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: int = Field(ge=400, le=599)
    message: str
    type: str = "BadRequestError"


class Faults(BaseModel):
    """Fault switches of one replica; replace :attr:`StandinReplica.faults` to change them.

    ``hang``: every request is accepted and not answered while the switch is on (once it is
    lifted, held requests are served, as by a SIGSTOPped process resumed); ``hang_paths``: the
    same for these paths only; ``hang_after``: a path (key) hangs like those once its trigger
    path (value) has been answered since the switches were set (``{"/is_paused":
    "/weight_info"}`` holds the first ``is_paused`` after a label was read back, not the ones
    before it); ``slow_health_s``: ``/health`` answers after that many seconds;
    ``stuck_transfer``: ``reload_weights`` never returns and holds the engine's utility turn
    (pause, resume, ``is_paused``... hang too; ``/health`` stays 200); ``fail_reload``:
    ``reload_weights`` fails with a 500 and leaves the engine poisoned, as a missing path does on
    vLLM: the next generation request kills the replica unless a good reload comes first. Dying
    and restarting are actions: :meth:`StandinReplica.die`, :meth:`StandinReplica.restart`.

    Answer faults of the inference routes (completions, chat completions, generate), for
    testing what a client of vLLM does with a broken or contradicting answer. A real vLLM cannot
    be told to produce any of them, so none is in the conformance suite (the stand-in's default,
    every switch off, is): ``fail_inference``: every inference request is answered with this
    vLLM-shaped error instead of generating (a 5xx also closes the connection, as uvicorn
    does); ``drop_inference``: every inference request's connection is reset unanswered;
    ``drop_stream_after``: a streamed answer's connection is reset after this many events
    (before ``[DONE]``); ``pad_bytes``: a whole (non-streamed) answer carries an extra ``"pad"``
    field of this many bytes, sent with a ``Content-Length``, or chunked without one if
    ``pad_chunked``; ``flood_events``: a streamed answer first sends this many 64 KiB events
    (a choice of ``"x"`` text), as fast as the client takes them; ``token_ids``: every choice
    reports these token ids in place of the ones generated (streamed: the slice of the tokens
    each chunk carries), whether or not the request asked for them; ``weight_versions``: every
    finished choice reports these spans (JSON as sent) in place of its own, on any version.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hang: bool = False
    hang_paths: frozenset[str] = frozenset()
    hang_after: dict[str, str] = Field(default_factory=dict)
    slow_health_s: float = Field(default=0.0, ge=0)
    stuck_transfer: bool = False
    fail_reload: bool = False
    fail_inference: InferenceFailure | None = None
    drop_inference: bool = False
    drop_stream_after: int | None = Field(default=None, ge=0)
    pad_bytes: int = Field(default=0, ge=0)
    pad_chunked: bool = False
    flood_events: int = Field(default=0, ge=0)
    token_ids: tuple[int, ...] | None = None
    weight_versions: tuple[dict[str, Any], ...] | None = None


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
    #: streamed answers send one event per token, each its own write, as vLLM does at one token
    #: per engine step (default: one event per choice per engine tick, several tokens each)
    stream_per_token: bool = False

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
        self._faults = Faults()
        self._faults_changed = asyncio.Event()
        #: paths of ``faults.hang_after`` whose trigger was answered (cleared with the faults)
        self.armed: set[str] = set()
        #: a recording switch: set to a list, and every inference request's JSON body is
        #: appended to it as received (what a real server does not echo: tests read what a
        #: client such as the router forwarded); ``None``: nothing is recorded
        self.recorded: list[dict[str, Any]] | None = None
        self.started_at = 0.0
        self.time = config.time
        self.model = config.model.expanduser().resolve()
        self.tokenizer = Tokenizer.of(self.model)
        self.chat_template = config.chat_template or _template_of(self.model)
        self.caps = parse_version(config.version)
        self.fingerprint = f"vllm-{config.version}-" + short(config.model_name)
        self.engine: SimEngine | None = None
        self.utility = asyncio.Lock()
        self.poisoned = False
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
            self.engine.set_time(model)

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
        # a fresh process's start (prometheus_client's process_start_time_seconds, 0.01 s
        # resolution): what the updater tells one server process from its successor by
        self.started_at = max(time.time(), self.started_at + 0.01)
        self.utility = asyncio.Lock()
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

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        """New fault switches; requests a lifted hang held are served now (as a process
        SIGSTOPped and then resumed answers what it had accepted)."""
        self._faults = faults
        self.armed = set()
        self._faults_changed.set()
        self._faults_changed = asyncio.Event()

    async def faults_changed(self) -> None:
        """Wait until the fault switches are replaced."""
        await self._faults_changed.wait()

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


def short(text: str) -> str:
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
        if e.status >= 500:  # uvicorn closes the connection after a 500, without a header
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
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
    while (
        replica.faults.hang
        or request.path in replica.faults.hang_paths
        or request.path in replica.armed
    ):
        await replica.faults_changed()  # accepted, held until the hang is lifted
    faults = replica.faults
    if request.path == "/health" and faults.slow_health_s:
        await asyncio.sleep(faults.slow_health_s)
    response: web.StreamResponse = await handler(request)
    if replica.faults is faults:  # armed by this answer, unless the switches changed meanwhile
        replica.armed.update(
            p for p, trigger in faults.hang_after.items() if trigger == request.path
        )
    return response


MIDDLEWARES = (_errors, _dispatch)


def ok(body: Any, status: int = 200) -> web.Response:
    """A JSON answer with vLLM's exact ``Content-Type`` (no charset parameter)."""
    return web.Response(body=dumps(body).encode(), status=status, headers=_JSON)


_JSON = {"Content-Type": "application/json"}


def generation_engine(rep: StandinReplica) -> SimEngine:
    """The engine a generation request runs on; a poisoned replica dies now (as vLLM's worker
    does on the first request after a failed reload) and the request is answered by no one."""
    engine = rep.live_engine()
    if rep.poisoned:
        asyncio.get_running_loop().create_task(rep.die())
        raise EngineDead(f"{rep.url}: the worker died on its first request after a failed reload")
    return engine


Kind = Literal["completion", "chat", "generate"]
