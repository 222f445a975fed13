"""Serving an app: both services run with aiohttp's ``handler_cancellation`` on.

With it, a client that disconnects cancels its request's handler (the router relies on this to
abort the generation upstream and end the rollout's binding); a handler whose work must finish
regardless shields it (:func:`asyncio.shield`). No access log (the services log what matters).
"""

from __future__ import annotations

import asyncio

from aiohttp import web


async def start_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port); returns once its cleanup contexts have
    set up. Returns the runner (``await runner.cleanup()`` stops it) and the bound port.

    If a cleanup context fails to set up, or the port cannot be bound, the contexts already set
    up are torn down before the error propagates.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple):
            bound = int(addr[1])
            break
    return runner, bound


def run(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then run its cleanup (the ``__main__`` entry).
    ``reuse_port``: bind with ``SO_REUSEPORT`` (several processes share the port); ``loop``:
    the event loop to run on (e.g. uvloop's)."""
    web.run_app(
        app,
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=None,
        reuse_port=reuse_port or None,
        loop=loop,
    )
