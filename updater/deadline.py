"""Deadlines around engine steps (I5).

:func:`bounded` runs a step as its own task and stops *waiting* for it when the deadline passes,
even if the step cannot be cancelled (an HTTP call that blocks inside an NCCL collective, run in
a thread, keeps running): the step is abandoned, :class:`~pool.errors.DeadlineExceeded` is
raised at the deadline, and the caller decides what that means (for a mutating step: TAINTED,
I4). The abandoned task's eventual result or exception is consumed and logged, never raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from pool.errors import DeadlineExceeded

log = logging.getLogger(__name__)
T = TypeVar("T")


def _consume(step: str) -> object:
    def done(task: asyncio.Future[object]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.warning("abandoned step %s ended later with %r", step, exc)

    return done


async def bounded(step: str, aw: Awaitable[T], deadline_s: float, *, mutating: bool) -> T:
    """Await ``aw`` for at most ``deadline_s`` seconds.

    Raises :class:`DeadlineExceeded` at the deadline (the step is cancelled if it can be and
    abandoned either way). If the caller is cancelled, the step is cancelled too.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=deadline_s)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_consume(step))  # type: ignore[arg-type]
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_consume(step))  # type: ignore[arg-type]
        raise DeadlineExceeded(
            f"{step} did not finish within {deadline_s:g} s", step=step, mutating=mutating
        )
    return task.result()
