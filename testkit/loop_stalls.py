"""How long this process's event loop could not run: a measured margin for timing assertions.

A scenario that bounds how late something happens in this process (a deadline firing, the commit
that follows it) must allow for the time the process was not scheduled or its loop was blocked;
on a loaded 2-core machine running CPU vLLM replicas that is seconds, and a guessed margin fails
there. :class:`LoopStalls` measures it: a ticker task sleeps ``tick_s`` at a time and adds up how
much later than asked each sleep ended. Every timer of the loop is late by the same stall, so the
sum bounds how much later than its own schedule any step of the loop ran in the window. Each
tick also adds the timer's ordinary jitter (about a millisecond), so a longer tick gives a tighter
bound; a stall counts in full whatever the tick.

Only the loop that enters it is measured (not Redis, not other processes).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class LoopStalls:
    """``async with LoopStalls() as s: ...``; then ``s.stalled_s`` is the loop's total lateness.

    Not reentrant; one ticker task per window, cancelled and awaited on exit (any exception of the
    window, and a cancellation of the caller, pass through).
    """

    def __init__(self, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self.stalled_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopStalls:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker starts now, not at the window's first await
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait({self._task})  # a cancellation of the caller still propagates

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.tick_s)
            self.stalled_s += max(0.0, loop.time() - t - self.tick_s)
