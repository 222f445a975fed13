"""``python -m updater [--config pool.yaml]``: run the updater service.

Settings come from the environment (``ROLLOUTPOOL_UPDATER_*``, ``ROLLOUTPOOL_REDIS_*``) and,
optionally, a YAML file whose ``updater:`` and ``redis:`` sections hold the same fields.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry

from pool.metrics import UpdaterMetrics
from pool.settings import StoreSettings
from pool.store import RedisStore
from updater.app import create_app, start_updater
from updater.service import Updater
from updater.settings import UpdaterSettings


def load(config: Path | None) -> tuple[UpdaterSettings, StoreSettings]:
    data: dict[str, Any] = {}
    if config is not None:
        data = yaml.safe_load(config.read_text()) or {}
    return UpdaterSettings(**data.get("updater", {})), StoreSettings(**data.get("redis", {}))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m updater")
    ap.add_argument("--config", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings, store_settings = load(args.config)
    registry = CollectorRegistry()
    updater = Updater(
        settings, RedisStore.connect(store_settings), metrics=UpdaterMetrics.create(registry)
    )
    app = create_app(updater, settings, registry)
    start_updater(app)
    web.run_app(app, host=settings.host, port=settings.port, print=None)


if __name__ == "__main__":
    main()
