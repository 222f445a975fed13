"""``python -m updater [--config pool.yaml]``: run the updater service.

Settings come from the environment (``ROLLOUTPOOL_UPDATER_*``, ``ROLLOUTPOOL_REDIS_*``) and,
optionally, a YAML file whose ``updater:`` and ``redis:`` sections hold the same fields. On
SIGINT/SIGTERM the app's cleanup stops the updater (and the replicas it launched), releases the
lease and closes the store client.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import yaml

from pool.settings import StoreSettings
from pool.web import run
from updater.app import create_app
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
    run(create_app(settings, store_settings), settings.host, settings.port)


if __name__ == "__main__":
    main()
