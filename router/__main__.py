"""``python -m router``: serve the router with settings from the environment.

``ROLLOUTPOOL_ROUTER_*`` configures the router (:class:`router.settings.RouterSettings`) and
``ROLLOUTPOOL_REDIS_*`` the store it shares with the updater
(:class:`pool.settings.StoreSettings`). Handler cancellation is on: a client that disconnects
cancels its request, which aborts the generation upstream and the rollout's binding.
"""

from __future__ import annotations

import logging

from pool.settings import StoreSettings
from pool.web import run
from router.app import create_app
from router.settings import RouterSettings


def main() -> None:
    settings = RouterSettings()
    store_settings = StoreSettings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("router").info(
        "router on %s:%d, redis %s namespace %s, model %r, max_staleness %d",
        settings.host,
        settings.port,
        store_settings.safe_url,
        store_settings.namespace,
        settings.served_model_name,
        settings.max_staleness,
    )
    run(create_app(settings, store_settings), settings.host, settings.port)


if __name__ == "__main__":
    main()
