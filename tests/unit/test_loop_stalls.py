"""The loop-stall meter that timing assertions in the scenarios derive their margin from."""

from __future__ import annotations

import asyncio
import time

from testkit.loop_stalls import LoopStalls


async def test_a_blocked_loop_counts_as_stalled() -> None:
    async with LoopStalls(tick_s=0.01) as s:
        time.sleep(0.3)  # noqa: ASYNC251  # the loop cannot run, as if the process were descheduled
        await asyncio.sleep(0.05)  # the ticker wakes and sees how late it is
    assert s.stalled_s >= 0.3 - 0.01, s.stalled_s


async def test_the_ticker_ends_with_the_window() -> None:
    async with LoopStalls(tick_s=0.01) as s:
        await asyncio.sleep(0.03)
    after = s.stalled_s
    time.sleep(0.1)  # noqa: ASYNC251  # a stall after the window
    await asyncio.sleep(0.05)
    assert s.stalled_s == after
