"""Stopping the child processes tests and benchmarks start (routers, updaters) for sure.

:func:`terminate` never raises: a teardown that raises halfway leaks every process after the one
that did not stop in time (seen: a router slow to shut down under load left two vLLM replicas
running for hours). The group gets SIGTERM, ``grace_s`` to exit, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> int | None:
    """Stop ``proc``'s process group (it must have been started with ``start_new_session``):
    SIGTERM, wait up to ``grace_s``, then SIGKILL and reap. Returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    return proc.returncode
