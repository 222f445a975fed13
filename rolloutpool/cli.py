"""The ``rolloutpool`` command (click): ``up``, ``status``, ``push``, ``demo``.

Every option has a help line with its default and its environment variable (``--help`` shows
them); every command's epilog has examples; ``push`` and ``status`` list the exit codes
(:class:`rolloutpool.errors.ExitCode`). A failure a user can cause (an unreachable service, a
wrong token, a refused checkpoint) ends with one ``Error: ...`` line on stderr and its exit code,
never a traceback.

The commands live beside what they use: ``up`` in :mod:`rolloutpool.up`, ``status`` in
:mod:`rolloutpool.status`, ``push`` in :mod:`rolloutpool.push`; ``demo`` (below) runs
:mod:`rolloutpool.demo`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from rolloutpool.errors import CliError, ExitCode
from rolloutpool.options import SETTINGS
from rolloutpool.push import push
from rolloutpool.status import status
from rolloutpool.up import pool_config, up


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


cli.add_command(up)
cli.add_command(status)
cli.add_command(push)


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
    default=None,
    envvar="ROLLOUTPOOL_DEMO_RESULTS",
    show_envvar=True,
    show_default="the results directory: $ROLLOUTPOOL_RESULTS, a checkout's bench/results, "
    "else ~/.local/share/rolloutpool/results",
    help="Where demo.json and demo.png go.",
)
def demo(
    config: Path | None,
    steps: int,
    push_every: int,
    router_port: int,
    updater_port: int,
    results: Path | None,
) -> None:
    """Run a tiny RL loop through a fresh local pool (about 3 minutes on 2 cores).

    REINFORCE on the tiny model, rollouts through the router, a checkpoint pushed every
    --push-every steps while background load checks that no rollout crosses a generation.
    """
    from pool.paths import default_results_dir
    from rolloutpool import demo as demo_run
    from rolloutpool.results import write

    cfg = pool_config(config, {})
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
    out = (results or default_results_dir()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(demo_run.run(loop_cfg, cfg, out))
    write("demo", result, out)
    if not (result["cross_generation"] == 0 and result["reward_last"] > result["reward_first"]):
        raise CliError(ExitCode.FAILED, "the demo's checks failed (see demo.json)")


def main(argv: list[str] | None = None) -> None:
    """The console script: runs :func:`cli` and exits with its code."""
    cli.main(args=argv, prog_name="rolloutpool")


if __name__ == "__main__":
    main()
