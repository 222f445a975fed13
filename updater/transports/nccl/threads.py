"""Blocking calls in daemon threads, awaited from the event loop: how the NCCL transports keep
the updater's deadlines while vLLM's HTTP calls and the sender's collectives block.

:func:`spawn` starts one call in a new daemon thread (an abandoned thread never blocks the
updater's exit); :func:`gather_threads` awaits several and ends at the first error.
Cancelling the awaiting coroutine only detaches it: the threads run on until their own limits
(an HTTP timeout, the group being abandoned).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["gather_threads", "spawn"]


def spawn(fn: Callable[..., Any], *args: Any, name: str) -> Future[Any]:
    """Run ``fn(*args)`` in a new *daemon* thread (an abandoned one never blocks exit)."""
    fut: Future[Any] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


async def gather_threads(*futs: Future[Any]) -> list[Any]:
    """Wait for all thread futures; the first error ends the wait (the rest are abandoned)."""
    afuts = [asyncio.wrap_future(f) for f in futs]
    try:
        done, pending = await asyncio.wait(afuts, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for a in afuts:
            a.cancel()  # only detaches; the threads keep running until their own limits
        raise
    for a in done:
        if a.exception() is not None:
            for p in pending:
                p.cancel()
            raise a.exception()  # type: ignore[misc]
    return [a.result() for a in afuts]
