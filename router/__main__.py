"""``python -m router [--workers N]``: serve the router with settings from the environment.

``ROLLOUTPOOL_ROUTER_*`` configures the router (:class:`router.settings.RouterSettings`) and
``ROLLOUTPOOL_REDIS_*`` the store it shares with the updater
(:class:`pool.settings.StoreSettings`). Handler cancellation is on: a client that disconnects
cancels its request, which aborts the generation upstream and the rollout's binding. The event
loop is uvloop's when uvloop is installed (a dependency), else asyncio's.

``--workers N`` (``ROLLOUTPOOL_ROUTER_WORKERS``; 0: one per core) serves from N processes on
one port (:mod:`router.workers`); 1, the default, serves from this process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pool.settings import StoreSettings
from pool.web import run
from router.app import create_app
from router.settings import RouterSettings
from router.workers import supervise, worker_count


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m router", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=None, help="processes (0: one per core)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 0:
        ap.error("--workers must be 0 (one per core) or more")
    settings = RouterSettings()
    store_settings = StoreSettings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("router")
    n = worker_count(settings.workers if args.workers is None else args.workers)
    if args.worker is None and n > 1:
        sys.exit(supervise(n, settings.host, settings.port))
    worker = None if args.worker is None else (args.worker, args.of)
    log.info(
        "router%s on %s:%d, redis %s namespace %s, model %r, max_staleness %d",
        "" if worker is None else f" worker {worker[0] + 1}/{worker[1]}",
        settings.host,
        settings.port,
        store_settings.safe_url,
        store_settings.namespace,
        settings.served_model_name,
        settings.max_staleness,
    )
    app = create_app(settings, store_settings, worker=worker)
    run(app, settings.host, settings.port, reuse_port=worker is not None, loop=new_event_loop())


if __name__ == "__main__":
    main()
