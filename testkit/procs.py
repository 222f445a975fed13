"""Stopping the child processes tests and benchmarks start (routers, updaters) for sure, and
bounding the steps of long scenarios.

:func:`terminate` never raises: a teardown that raises halfway leaks every process after the one
that did not stop in time (seen: a router slow to shut down under load left two vLLM replicas
running for hours). The group gets SIGTERM, ``grace_s`` to exit, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
from collections.abc import AsyncIterator


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


def task_stacks(limit: int = 6) -> str:
    """Every asyncio task of the running loop with where it waits (``limit`` frames each)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        out.write(f"-- {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(limit=limit, file=out)
    return out.getvalue()


@contextlib.asynccontextmanager
async def bounded(what: str, timeout_s: float) -> AsyncIterator[None]:
    """Run the block for at most ``timeout_s``; past it, raise :class:`TimeoutError` naming
    ``what`` with every task's stack, so a hang in a long scenario says where it hangs."""
    limit = asyncio.timeout(timeout_s)
    try:
        async with limit:
            yield
    except TimeoutError:
        if not limit.expired():
            raise  # the block's own
        raise TimeoutError(f"{what}: not done within {timeout_s:g} s\n{task_stacks()}") from None
