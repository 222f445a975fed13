"""Run a RolloutPool on an existing Ray cluster, as a Ray job: the updater and one router in the
job's driver, each replica a Ray actor that owns its vLLM server (``provider: ray``).

    ray job submit --address http://<head>:8265 --working-dir . -- \\
        python deploy/ray/pool_job.py --config deploy/ray/pool.yaml

The config has the sections of ``python -m updater --config`` (``updater:``, ``redis:``) plus
``router:`` (:class:`router.settings.RouterSettings` fields). Secrets come from the environment
(``ROLLOUTPOOL_UPDATER_ADMIN_TOKEN``, ``ROLLOUTPOOL_REDIS_PASSWORD``, ...; pass them with
``--runtime-env-json``), never from the file. Redis is yours (``redis.url``): the pool's state
must outlive the job.

Inside the job ``ray.init`` joins the job's cluster (``updater.ray.address`` stays unset). The
replica actors are detached and named: when the job is stopped (``ray job stop``: SIGTERM), the
updater taints its replicas and kills their actors; if the driver dies instead, they keep
serving and a resubmitted job adopts those still READY on the latest generation as the very
process that was validated (the rest are restarted fresh). The updater and router can also run
outside the cluster (``updater.ray.address: ray://<head>:10001`` through Ray Client, or
``<head>:6379`` from a machine that is a Ray node), see docs/guides/deploy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from pool.metrics import UpdaterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore
from router.app import create_app as create_router
from router.app import start_server
from router.settings import RouterSettings
from updater.app import create_app as create_updater
from updater.service import Updater
from updater.settings import UpdaterSettings

log = logging.getLogger("pool_job")


async def serve(data: dict[str, Any]) -> None:
    usettings = UpdaterSettings(**data.get("updater", {}))
    ssettings = StoreSettings(**data.get("redis", {}))
    rsettings = RouterSettings(**data.get("router", {}))
    registry = CollectorRegistry()
    store = RedisStore.connect(ssettings)
    updater = Updater(usettings, store, metrics=UpdaterMetrics.create(registry))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runners = []
    try:
        log.info("placing %d replicas as Ray actors", len(usettings.replicas))
        await updater.start()
        app = create_updater(updater, usettings, registry)
        runners.append((await start_server(app, usettings.host, usettings.port))[0])
        router = create_router(rsettings, ssettings)
        runners.append((await start_server(router, rsettings.host, rsettings.port))[0])
        log.info("router on %s:%d, updater on %s:%d", rsettings.host, rsettings.port,
                 usettings.host, usettings.port)  # fmt: skip
        await stop.wait()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await updater.stop()
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(prog="pool_job.py")
    ap.add_argument("--config", type=Path, default=Path(__file__).with_name("pool.yaml"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(yaml.safe_load(args.config.read_text()) or {}))


if __name__ == "__main__":
    main()
