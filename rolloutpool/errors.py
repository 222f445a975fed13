"""Exit codes of the ``rolloutpool`` command and the one error it shows a person.

A command fails by raising :class:`CliError` (a ``click.ClickException``): click prints
``Error: <message>`` on stderr, one line, and exits with its code. Errors a user can cause never
end in a traceback; an unexpected exception (a bug) still does.
"""

from __future__ import annotations

from enum import IntEnum

import click
import httpx


class ExitCode(IntEnum):
    """What ``rolloutpool`` exits with (the help and docs/reference/cli.md list them)."""

    OK = 0
    FAILED = 1  # the update failed or was superseded (push); the pool did not start (up)
    USAGE = 2  # a bad command line or config file (click's own usage errors exit 2 too)
    REFUSED = 3  # the checkpoint was refused: by the updater (preflight, label), or no probe
    UNREACHABLE = 4  # the updater / router cannot be reached or is unavailable (5xx)
    AUTH = 5  # a missing or wrong admin token / API key (401, 403)
    TIMEOUT = 6  # the update still runs at --timeout (it goes on in the updater)
    INTERRUPTED = 130  # Ctrl-C while waiting (the update goes on in the updater)


#: ``rolloutpool push --help`` and ``status --help`` print this table.
EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  the update failed or was superseded by a newer push
  2  bad command line
  3  the checkpoint was refused (updater preflight, label taken, no probe)
  4  the updater or router cannot be reached, or is unavailable
  5  a missing or wrong admin token / API key
  6  --timeout passed while the update still runs (it goes on)
  130  interrupted (Ctrl-C); a queued update goes on"""


class CliError(click.ClickException):
    """A failure a person can act on: ``message`` is one line, ``code`` the exit status."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(" ".join(message.split()))
        # click declares exit_code a class variable but reads it from the instance it catches
        self.exit_code = int(code)  # type: ignore[misc]


def auth_header(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def describe(e: httpx.HTTPError) -> str:
    """httpx's reason in a few words (``[Errno 111] Connection refused``, ``timed out``)."""
    text = str(e).strip()
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({text})" if text else "timed out"
    return text or type(e).__name__


__all__ = ["EXIT_CODES_HELP", "CliError", "ExitCode", "auth_header", "describe"]
