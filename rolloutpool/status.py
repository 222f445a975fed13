"""What ``rolloutpool status`` reads and prints: the router's pool view and, from the updater, the
last update's outcome.

* :func:`read_pool` — ``GET <router>/v1/pool`` with the client's bearer token (an API key or
  the admin token; the router asks for one when it has API keys configured). Raises
  :class:`CliError` with one line a person can act on when the router cannot be reached,
  refuses the token or answers something that is not a pool view.
* :func:`read_last_update` — the newest record of ``GET <updater>/v1/updates`` (admin token).
  Never raises: without a token, or when the updater cannot tell, it returns a note saying so.
* :func:`render` — the text (the same for a terminal and a pipe).
* :func:`status` — the command; ``--watch`` refreshes in place on a terminal and prints one
  block (or JSON line) per refresh when piped.

Blocking (httpx, synchronous); each call makes at most one request with a 5 s timeout.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import httpx
from pydantic import ValidationError
from rich.console import Console
from rich.live import Live
from rich.text import Text

from pool.records import ReplicaOutcome, UpdateRecord
from pool.types import ReplicaState
from pool.web import PoolView
from rolloutpool.errors import EXIT_CODES_HELP, CliError, ExitCode, auth_header, describe
from rolloutpool.options import base_url, router_option, token_option, updater_option
from rolloutpool.progress import seconds
from updater.client import UpdaterAPIError, UpdaterClient

TIMEOUT_S = 5.0


def read_pool(router: str, token: str | None) -> PoolView:
    """The router's ``/v1/pool`` (see the module docstring for the errors)."""
    try:
        r = httpx.get(f"{router}/v1/pool", headers=auth_header(token), timeout=TIMEOUT_S)
    except httpx.HTTPError as e:
        raise CliError(
            ExitCode.UNREACHABLE, f"cannot reach the router at {router}: {describe(e)}"
        ) from e
    body = _json(r)
    message = body.get("error", {}).get("message", r.reason_phrase)
    if r.status_code in (401, 403):
        hint = (
            "give an API key (--api-key or ROLLOUTPOOL_API_KEY) or the admin token (--token)"
            if token is None
            else "the key given is not one of the router's API keys"
        )
        raise CliError(ExitCode.AUTH, f"the router at {router} refused: {message}; {hint}")
    if r.status_code >= 400:
        raise CliError(
            ExitCode.UNREACHABLE, f"the router at {router} answered {r.status_code}: {message}"
        )
    try:
        return PoolView.model_validate(body)
    except ValidationError:
        raise CliError(
            ExitCode.UNREACHABLE,
            f"{router}/v1/pool is not a RolloutPool pool view (is --router the router's URL?)",
        ) from None


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


@dataclass(frozen=True)
class LastUpdate:
    """The newest update record, or why there is none to show (``note``)."""

    record: UpdateRecord | None
    note: str | None


def read_last_update(updater: str, token: str | None) -> LastUpdate:
    """The updater's newest update record (see the module docstring)."""
    if not token:
        return LastUpdate(
            None,
            "not shown: the updater's records need the admin token "
            "(--token or ROLLOUTPOOL_ADMIN_TOKEN)",
        )
    try:
        with UpdaterClient(updater, token, timeout_s=TIMEOUT_S) as client:
            records = client.list(limit=1)
    except httpx.HTTPError as e:
        return LastUpdate(
            None, f"unavailable: cannot reach the updater at {updater}: {describe(e)}"
        )
    except UpdaterAPIError as e:
        return LastUpdate(None, f"unavailable: the updater at {updater} refused: {e.message}")
    except (KeyError, TypeError):
        return LastUpdate(None, f"unavailable: {updater} is not a RolloutPool updater")
    if not records:
        return LastUpdate(None, "none yet")
    try:
        return LastUpdate(UpdateRecord.model_validate(records[0]), None)
    except ValidationError:
        return LastUpdate(None, f"unavailable: {updater} answered a record this CLI cannot read")


def _ago(ms: int, now_ms: int) -> str:
    return f"{seconds(max(0, now_ms - ms) / 1000)} ago"


def render_update(rec: UpdateRecord, now_ms: int) -> list[str]:
    """The last update in a few lines: state, timing, each replica's outcome."""
    head = f"{rec.id}: generation {rec.generation} ({rec.label}) {rec.state.value}"
    if rec.finished_ms is not None:
        took = seconds((rec.finished_ms - rec.created_ms) / 1000)
        head += f" {_ago(rec.finished_ms, now_ms)}, after {took}"
    else:
        head += f", pushed {_ago(rec.created_ms, now_ms)}"
    if rec.staleness_window_s is not None:
        head += f" (staleness window {seconds(rec.staleness_window_s)})"
    lines = [head]
    if rec.error:
        lines.append(f"  error: {rec.error}")
    for r in rec.replicas.values():
        if r.outcome is ReplicaOutcome.RUNNING:
            text = f"  {r.replica:<12} running: {r.phase or 'between phases'}"
        else:
            text = f"  {r.replica:<12} {r.outcome.value}"
        if r.window_s is not None:
            text += f", update window {seconds(r.window_s)}"
        if r.reason:
            text += f": {r.reason}"
        lines.append(text)
    return lines


def render(router: str, view: PoolView, last: LastUpdate, now_ms: int | None = None) -> str:
    """The status text: published generation, one row per replica, the last update."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    lines = [f"router       {router}"]
    if view.latest is None:
        lines.append("published    nothing yet (no generation is committed)")
    else:
        lines.append(
            f"published    generation {view.latest.generation} ({view.latest.label}), "
            f"identity {view.latest.identity_digest[:12]}, max staleness {view.max_staleness}"
        )
    lines.append("")
    lines.append(
        f"{'replica':<14}{'state':<14}{'gen':>4}  {'label':<12}{'active':>7}{'capacity':>9}"
    )
    for r in view.replicas:
        gen = "-" if r.generation is None else str(r.generation)
        lines.append(
            f"{r.replica_id:<14}{r.state.value:<14}{gen:>4}  {r.label or '-':<12}"
            f"{r.active:>7}{r.capacity:>9}"
        )
        if r.reason and r.state is not ReplicaState.READY:
            lines.append(f"  {r.reason}")
    if not view.replicas:
        lines.append("(no replica is registered)")
    lines.append("")
    if last.record is not None:
        first, *rest = render_update(last.record, now_ms)
        lines.append(f"last update  {first}")
        lines.extend(rest)
    else:
        lines.append(f"last update  {last.note}")
    return "\n".join(lines)


def as_json(router: str, view: PoolView, last: LastUpdate) -> dict[str, Any]:
    """What ``status --json`` prints."""
    return {
        "router": router,
        "pool": view.model_dump(mode="json"),
        "last_update": None if last.record is None else last.record.model_dump(mode="json"),
        "last_update_note": last.note,
    }


# ---------------------------------------------------------------------------------- command


def _watch(read: Callable[[], tuple[str, dict[str, Any]]], every: float, json_out: bool) -> None:
    """Show ``read()`` every ``every`` s until Ctrl-C: in place on a terminal, else one block
    (or JSON line) per refresh. A service out of reach is shown and retried; a refused token
    ends the watch (it will not fix itself).

    Ctrl-C (SIGINT) sets a flag instead of raising ``KeyboardInterrupt``: an interrupt that lands
    in a finalizer (e.g. a closing HTTP connection's) is printed and dropped by Python, which
    left the watch running. The watch ends after the refresh in progress (at most its 5 s
    request timeout)."""
    console = Console()
    live = None
    if console.is_terminal and not json_out:
        live = Live(console=console, auto_refresh=False)
        live.start()
    stop = threading.Event()
    main = threading.current_thread() is threading.main_thread()  # else no signal reaches it
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if main else None
    try:
        while not stop.is_set():
            stamp = time.strftime("%H:%M:%S")
            try:
                text, data = read()
            except CliError as e:
                if e.exit_code == ExitCode.AUTH:
                    raise
                text, data = f"Error: {e.message}", {"error": e.message}
            if json_out:
                click.echo(json.dumps({"time": stamp, **data}))
            elif live is not None:
                head = f"{stamp}  refreshed every {every:g}s; Ctrl-C stops\n\n"
                live.update(Text(head + text), refresh=True)
            else:
                click.echo(f"--- {stamp}\n{text}\n")
            stop.wait(every)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        if live is not None:
            live.stop()


@click.command(
    epilog=f"""\b
Examples:
  rolloutpool status
  rolloutpool status --token $TOKEN --watch          refresh every 2 s; with the last update
  rolloutpool status --router http://pool:8000 --api-key $KEY --json

{EXIT_CODES_HELP}"""
)
@router_option
@updater_option
@click.option(
    "--api-key",
    metavar="KEY",
    envvar="ROLLOUTPOOL_API_KEY",
    show_envvar=True,
    show_default="none: the admin token, if given",
    help="A client API key for the router (needed when the router has API keys).",
)
@token_option("for the last update; also accepted by the router")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.2),
    is_flag=False,
    flag_value=2.0,
    default=None,
    metavar="[SECONDS]",
    envvar="ROLLOUTPOOL_STATUS_WATCH",
    show_envvar=True,
    show_default="off; 2 s without a value",
    help="Refresh every SECONDS until Ctrl-C.",
)
@click.option(
    "--json",
    "json_out",
    is_flag=True,
    envvar="ROLLOUTPOOL_STATUS_JSON",
    show_envvar=True,
    show_default="off",
    help="Print JSON: {router, pool, last_update, last_update_note} (one line per refresh).",
)
def status(
    router: str,
    updater: str,
    api_key: str | None,
    token: str | None,
    watch: float | None,
    json_out: bool,
) -> None:
    """Show the published generation, every replica and the last update.

    Per replica: state, generation, label, active rollouts and capacity (from the router's
    /v1/pool). The last update's outcome comes from the updater and needs the admin token;
    without it the status says so.
    """
    router, updater = base_url(router), base_url(updater)

    def read() -> tuple[str, dict[str, Any]]:
        view = read_pool(router, api_key or token)
        last = read_last_update(updater, token)
        return render(router, view, last), as_json(router, view, last)

    if watch is None:
        text, data = read()
        click.echo(json.dumps(data) if json_out else text)
    else:
        _watch(read, watch, json_out)


__all__ = [
    "LastUpdate",
    "as_json",
    "read_last_update",
    "read_pool",
    "render",
    "render_update",
    "status",
]
