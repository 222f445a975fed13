"""A fault-injecting HTTP proxy in front of one real vLLM server (benchmarks and tests only).

Everything is forwarded unchanged, except that while :attr:`FaultProxy.hang_paths` contains a
path, requests to it are held forever (the client sees a call that never returns, like an RPC
whose collective peer died). A real server cannot be made to hang on demand; this is the one
fault we inject. Streaming responses are relayed chunk by chunk.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from testkit.redis_server import free_port

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultProxy:
    def __init__(self, upstream: str, port: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port or free_port()
        self.hang_paths: set[str] = set()
        self.held = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in self.hang_paths:
            self.held += 1
            await asyncio.Event().wait()
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in HOP:
                    resp.headers[k] = v
            try:
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionResetError:  # the client went away; nothing to relay to
                pass
            return resp

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
