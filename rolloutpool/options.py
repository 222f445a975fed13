"""What the ``rolloutpool`` commands share: click settings, the service URLs and the admin
token option (one environment variable each, the same for every command)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

ROUTER = "http://127.0.0.1:8000"
UPDATER = "http://127.0.0.1:8300"
SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def base_url(url: str) -> str:
    """A service's base URL: no trailing slash, no ``/v1`` (the OpenAI base URL works too)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def router_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--router",
        metavar="URL",
        default=ROUTER,
        envvar="ROLLOUTPOOL_ROUTER",
        show_envvar=True,
        show_default=True,
        help="The router's base URL.",
    )(f)


def updater_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--updater",
        metavar="URL",
        default=UPDATER,
        envvar="ROLLOUTPOOL_UPDATER",
        show_envvar=True,
        show_default=True,
        help="The updater's base URL.",
    )(f)


def token_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--token",
        metavar="TOKEN",
        envvar="ROLLOUTPOOL_ADMIN_TOKEN",
        show_envvar=True,
        show_default="none",
        help=f"The pool's admin token ({what}).",
    )
