"""Many stand-in replicas in one process, and the admin endpoint that steers them.

:class:`StandinFleet` owns one aiohttp application and runner (with handler cancellation, so a
client that disconnects aborts its requests, as on vLLM) and one listening socket per replica.
Use it as an async context manager; everything runs on the caller's event loop, no threads
(besides one short ``asyncio.to_thread`` per checkpoint load).

The admin endpoint (``admin_port``; the pool never calls it) lets separate processes, e.g. a
benchmark driving the real router and updater, flip faults and rates::

    GET  /replicas                      every replica's status
    POST /replicas/{i|all}/faults       body: Faults fields to change (merged)
    POST /replicas/{i|all}/time         body: TimeModel fields to change (merged)
    POST /replicas/{i|all}/die          stop listening, reset connections
    POST /replicas/{i|all}/restart      body: {"model": "/abs/ckpt"} (optional); waits startup_s

Errors are ``{"error": {"code", "message"}}`` with 400 (bad body) or 404 (no such replica).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from testkit.standin.routes import create_app
from testkit.standin.server import ReplicaConfig, StandinReplica
from testkit.standin.weights import WeightsError

__all__ = ["StandinFleet"]

M = TypeVar("M", bound=BaseModel)


class StandinFleet:
    """Stand-in replicas sharing one application on this event loop (see the module doc)."""

    def __init__(self, *, admin_port: int | None = None, admin_host: str = "127.0.0.1") -> None:
        self.replicas: list[StandinReplica] = []
        self.admin_port = admin_port
        self.admin_host = admin_host
        self._runner = web.AppRunner(
            create_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        self._admin: web.AppRunner | None = None

    async def __aenter__(self) -> StandinFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def admin_url(self) -> str | None:
        if self.admin_port is None:
            return None
        return f"http://{self.admin_host}:{self.admin_port}"

    async def start(self) -> StandinFleet:
        """Set up the shared runner (and the admin site when ``admin_port`` is not None)."""
        await self._runner.setup()
        if self.admin_port is not None:
            self._admin = web.AppRunner(_admin_app(self), access_log=None, shutdown_timeout=0.5)
            await self._admin.setup()
            site = web.TCPSite(self._admin, self.admin_host, self.admin_port)
            await site.start()
            self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def add(self, config: ReplicaConfig) -> StandinReplica:
        """Bind, start (waiting ``startup_s``) and return one more replica."""
        return (await self.add_many([config]))[0]

    async def add_many(self, configs: Iterable[ReplicaConfig]) -> list[StandinReplica]:
        """Bind all (so their ports are known at once), then start them concurrently."""
        new = []
        for config in configs:
            new.append(StandinReplica(config, self._runner, index=len(self.replicas)))
            self.replicas.append(new[-1])
        await asyncio.gather(*(r.start() for r in new))
        return new

    async def close(self) -> None:
        """Kill every replica (open requests get no answer), then stop the servers."""
        for r in self.replicas:
            await r.die()
            r.close_socket()
        await self._runner.cleanup()
        if self._admin is not None:
            await self._admin.cleanup()


# ------------------------------------------------------------------------------ admin


def _admin_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _bad(message: str) -> web.HTTPBadRequest:
    body = {"error": {"code": "bad_request", "message": message}}
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


def _admin_app(fleet: StandinFleet) -> web.Application:
    async def targets(request: web.Request) -> list[StandinReplica]:
        which = request.match_info["which"]
        if which == "all":
            return list(fleet.replicas)
        if which.isdigit() and int(which) < len(fleet.replicas):
            return [fleet.replicas[int(which)]]
        raise web.HTTPNotFound(
            text=f'{{"error": {{"code": "not_found", "message": "no replica {which!r}"}}}}',
            content_type="application/json",
        )

    async def body_of(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json() if request.body_exists else {}
        except ValueError as e:
            raise _bad(str(e)) from e
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        return body

    def merged(body: dict[str, Any], current: M) -> M:
        try:
            return type(current).model_validate({**current.model_dump(), **body})
        except ValidationError as e:
            raise _bad(str(e)) from e

    async def status(request: web.Request) -> web.Response:
        return web.json_response([r.status() for r in fleet.replicas])

    async def faults(request: web.Request) -> web.Response:
        reps, body = await targets(request), await body_of(request)
        for r in reps:
            r.faults = merged(body, r.faults)
        return web.json_response([r.status() for r in reps])

    async def set_time(request: web.Request) -> web.Response:
        reps, body = await targets(request), await body_of(request)
        for r in reps:
            r.set_time(merged(body, r.time))
        return web.json_response([r.status() for r in reps])

    async def die(request: web.Request) -> web.Response:
        reps = await targets(request)
        await asyncio.gather(*(r.die() for r in reps))
        return web.json_response([r.status() for r in reps])

    async def restart(request: web.Request) -> web.Response:
        reps, body = await targets(request), await body_of(request)
        model = body.get("model")
        path = Path(model) if isinstance(model, str) else None
        try:
            await asyncio.gather(*(r.restart(path) for r in reps))
        except WeightsError as e:
            return _admin_error(400, "bad_model", e.message)
        return web.json_response([r.status() for r in reps])

    app = web.Application()
    app.router.add_get("/replicas", status)
    app.router.add_post("/replicas/{which}/faults", faults)
    app.router.add_post("/replicas/{which}/time", set_time)
    app.router.add_post("/replicas/{which}/die", die)
    app.router.add_post("/replicas/{which}/restart", restart)
    return app
