"""``rolloutpool push``: check the updater and the token, compute the validation probe (or read
``--probe``), push, and follow the update (:func:`follow`, with a view of
:mod:`rolloutpool.progress`) until it ends or ``--timeout`` passes.

Local input (the checkpoint directory, ``--probe``) is checked before any request, and the
token before the seconds a probe computation takes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console

from pool.records import UpdateRecord, UpdateState
from pool.web import PoolView
from rolloutpool import progress
from rolloutpool.errors import EXIT_CODES_HELP, CliError, ExitCode, describe
from rolloutpool.options import base_url, token_option, updater_option
from updater.client import UpdateFailed, UpdaterAPIError, UpdaterClient


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


def _adapter_base(checkpoint: Path, base: Path | None) -> Path | None:
    """For a LoRA adapter directory (it has ``adapter_config.json``): the base model to compute
    its probe on, ``--base`` or the adapter's ``base_model_name_or_path`` where that is a local
    directory; None for a full checkpoint."""
    config = checkpoint / "adapter_config.json"
    if not config.is_file():
        return None
    if base is not None:
        return base.expanduser().resolve()
    try:
        named = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and Path(named).is_dir():
        return Path(named).resolve()
    raise CliError(
        ExitCode.USAGE,
        f"{checkpoint} is a LoRA adapter: its probe is computed on the base model; give "
        "--base DIR (the pool's base model) or --probe",
    )


def _probe(checkpoint: Path, margin: float, base: Path | None) -> tuple[list[int], list[int]]:
    """The validation probe computed from ``checkpoint`` (see :mod:`updater.probe`), a full
    checkpoint or, with ``base``, a LoRA adapter on that base model."""
    try:
        from updater.probe import probe_from_adapter, probe_from_checkpoint

        hf_logging: Any = importlib.import_module("transformers.utils.logging")
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if base is not None:
            return probe_from_adapter(checkpoint, base, margin=margin)
        return probe_from_checkpoint(checkpoint, margin=margin)
    except ImportError as e:
        raise CliError(
            ExitCode.REFUSED,
            f"computing the validation probe needs torch and transformers (and peft for an "
            f"adapter) ({e}); install the cpu or gpu extra (and the trl extra)",
        ) from e
    except Exception as e:  # transformers/torch/safetensors refusing the user's directory
        raise CliError(
            ExitCode.REFUSED,
            f"no validation probe from {checkpoint}: {type(e).__name__}: {str(e)[:300]}",
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


@click.command(
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
    "--base",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    envvar="ROLLOUTPOOL_PUSH_BASE",
    show_envvar=True,
    show_default="the adapter's base_model_name_or_path",
    help="A LoRA pool: the base model CHECKPOINT (an adapter) is computed on for its probe.",
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
    base: Path | None,
    margin: float,
    timeout: float,
    no_wait: bool,
    mode: str,
    json_out: bool,
) -> None:
    """Push CHECKPOINT and follow its rolling update.

    CHECKPOINT is a directory of safetensors weights of the pool's architecture, or in a pool
    whose generations are LoRA adapters a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors), at a path the updater and the replicas can read too. push
    checks the updater and the token, computes the validation probe from the checkpoint
    unless --probe gives one (the greedy tokens the new weights must produce; transformers on
    CPU; an adapter's on --base), pushes, and shows each replica's phases (drain, transfer,
    invalidate, validate, resume; an adapter's load, validate, admit, with seconds) until the
    update ends.
    """
    updater = base_url(updater)
    if mode == "auto":
        mode = "none" if json_out else ("live" if sys.stdout.isatty() else "lines")
    machine = json_out or mode == "jsonl"
    say = (lambda m: click.echo(m, err=True)) if machine else click.echo
    ckpt = checkpoint.expanduser().resolve()
    if not ckpt.is_dir():
        raise CliError(ExitCode.REFUSED, f"the checkpoint {ckpt} is not a directory")
    probe = None if probe_file is None else _read_probe(probe_file)
    adapter_base = None if probe is not None else _adapter_base(ckpt, base)
    queued: dict[str, Any] | None = None
    try:
        with UpdaterClient(updater, token) as client:
            with _calling(updater, "checking the token", refused=False):
                client.list(limit=1)
            if probe is None:
                say(f"computing the validation probe of {ckpt} ...")
                probe = _probe(ckpt, margin, adapter_base)
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
