"""The wave barrier of ``nccl_direct``: k concurrent cycles, one broadcast.

When the rolling plan updates k > 1 replicas at once, the updater says so first
(:meth:`~updater.transports.base.Transport.expect_wave` with their URLs); each replica's cycle
then drains, pauses and calls ``transfer`` on its own, at its own time. The transport parks each
such transfer here (:meth:`WaveBarrier.join`) until the wave is complete, then sends once to all
that arrived (one NCCL group: sender + every worker of the wave; one broadcast per tensor), and
hands each replica its own result. Each cycle goes on alone from there: it validates its
replica's checksums, probes and resumes it, or taints it.

**Who is in the wave.** The wave closes when every planned replica arrived or left, or
``gather_s`` after the first arrival, whichever is first. A replica *leaves* when its transfer
will not come (its preflight refused, its engine was found not paused) or was cancelled while
waiting (its deadline). Arrivals with another target than the first are not part of it. A
replica that arrives after the close, or is alone in its wave, is sent alone (the per-replica
path of ``nccl_direct``, unchanged). So ``gather_s`` bounds how long an early replica stays
paused for a late one.

**Results.** The send hands every member either its :class:`~pool.evidence.TransferEvidence`
(the sender's broadcast and this member's receive both completed) or a reason to be sent alone
(anything else: the wave group could not be made, the sender or this member's receive failed).
A member sent alone is re-sent the whole model over its own group, within its own cycle's
transfer deadline; only a member whose own transfer then fails is TAINTED. A send that raises
is a reason for all of its members.

Runs on the transport's event loop (not thread-safe); the send runs as a task of its own, so a
member cancelled (its deadline) never cancels the broadcast the others wait for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pool.engine import VllmEngine
from pool.evidence import TransferEvidence
from updater.transports.base import WeightsTarget

__all__ = ["Arrival", "WaveBarrier"]

log = logging.getLogger(__name__)

#: What the send hands a member: its evidence, or why it is to be sent alone.
Outcome = TransferEvidence | str


@dataclass
class Arrival:
    """One replica's transfer, parked at the barrier. ``checked`` is what the transport's
    preflight established for it; ``result`` is set by the send (or the barrier)."""

    url: str
    engine: VllmEngine
    target: WeightsTarget
    checked: Any
    t_start: float
    result: asyncio.Future[Outcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class _Wave:
    def __init__(self, urls: Collection[str]) -> None:
        self.expected = set(urls)
        self.members: dict[str, Arrival] = {}
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None


class WaveBarrier:
    """Gathers the transfers of a planned wave (see the module docstring). ``send`` is called
    once per closed wave of at least two members and must set every member's ``result``."""

    def __init__(self, gather_s: float, send: Callable[[list[Arrival]], Awaitable[None]]) -> None:
        self.gather_s = gather_s
        self._send = send
        self._planned: dict[str, _Wave] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def plan(self, urls: Collection[str]) -> None:
        """The next transfers into ``urls`` form one wave (fewer than two, or ``gather_s`` 0:
        nothing to gather). A replica still planned in an earlier wave moves to this one."""
        clean = {u.rstrip("/") for u in urls}
        if len(clean) < 2 or self.gather_s <= 0:
            return
        wave = _Wave(clean)
        for url in clean:
            old = self._planned.get(url)
            if old is not None:
                self._leave(old, url)
            self._planned[url] = wave

    def planned(self, url: str) -> bool:
        """Whether the next transfer into ``url`` is part of a wave still gathering."""
        wave = self._planned.get(url.rstrip("/"))
        return wave is not None and not wave.closed

    def leave(self, url: str) -> None:
        """The transfer into ``url`` will not come (or not to this wave)."""
        wave = self._planned.get(url.rstrip("/"))
        if wave is not None:
            self._leave(wave, url.rstrip("/"))

    async def join(self, arrival: Arrival) -> Outcome:
        """Wait for the wave of ``arrival.url`` to be sent; its outcome for this member (a
        reason string: send it alone). Cancelling the wait leaves the wave without this member
        if it was still gathering; a wave already sending goes on."""
        url = arrival.url
        wave = self._planned.get(url)
        if wave is None or wave.closed:
            return "not in a gathering wave"
        first = next(iter(wave.members.values()), None)
        if first is not None and first.target != arrival.target:
            self._leave(wave, url)
            return "another target than its wave's"
        wave.members[url] = arrival
        if first is None:
            wave.timer = asyncio.get_running_loop().call_later(self.gather_s, self._close, wave)
        self._maybe_close(wave)
        try:
            return await asyncio.shield(arrival.result)
        except asyncio.CancelledError:
            if not wave.closed:
                wave.members.pop(url, None)
                self._leave(wave, url)
            raise

    # -- internals -----------------------------------------------------------------------------

    def _leave(self, wave: _Wave, url: str) -> None:
        wave.expected.discard(url)
        if self._planned.get(url) is wave:
            del self._planned[url]
        self._maybe_close(wave)

    def _maybe_close(self, wave: _Wave) -> None:
        if not wave.closed and wave.members and wave.expected <= set(wave.members):
            self._close(wave)

    def _close(self, wave: _Wave) -> None:
        if wave.closed:
            return
        wave.closed = True
        if wave.timer is not None:
            wave.timer.cancel()
        for url in wave.expected:
            if self._planned.get(url) is wave:
                del self._planned[url]
        members = list(wave.members.values())
        if len(members) < 2:
            for m in members:
                _settle(m, "alone in its wave")
            return
        task = asyncio.get_running_loop().create_task(self._run(members))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, members: list[Arrival]) -> None:
        try:
            await self._send(members)
        except BaseException as e:  # every member must get an outcome
            log.warning("wave of %s failed: %r", [m.url for m in members], e)
            for m in members:
                _settle(m, f"the wave failed: {type(e).__name__}: {e}")
            if isinstance(e, asyncio.CancelledError):
                raise
        for m in members:
            _settle(m, "the wave gave it no outcome")


def _settle(member: Arrival, outcome: Outcome) -> None:
    if not member.result.done():
        member.result.set_result(outcome)
