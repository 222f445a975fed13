"""Group commit for the hot scripts (ADMIT, RELEASE): concurrent calls share round trips.

A call made while no batched call is in flight goes to Redis at once, alone (no added latency
for a lone client). Calls made while one is in flight queue, and are sent together, as one
pipeline of ``EVALSHA`` commands (``transaction=False``), as soon as the round trip in flight
returns. Each script stays its own atomic unit with its own result: a pipeline only saves the
round trips and the client's per-command work, it does not make the scripts one transaction.

Contracts:

* A caller that is cancelled does not cancel its script: a queued call is sent anyway and its
  result dropped, exactly as for a script already on the wire.
* A reply error for one command (a script's own error, or ``NOSCRIPT`` after Redis lost its
  script cache, in which case that call is retried alone, which loads the script) affects that
  call only; a connection failure fails every call of the batch, each with the translated error.
* Not used with Redis Cluster (the store's calls stay direct there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

#: How the store runs one redis-py call and translates its errors (``StoreClient.call``).
Call = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


@dataclass
class _Pending:
    script: AsyncScript
    keys: list[str]
    args: list[str]
    future: asyncio.Future[Any]


class ScriptBatcher:
    """Batches script calls on one client; one instance per store, used from one event loop."""

    def __init__(self, client: Any, call: Call, translate: Callable[[Exception], Exception]):
        self._r = client
        self._call = call
        self._translate = translate
        self._queue: list[_Pending] = []
        self._busy = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, script: AsyncScript, keys: list[str], args: list[str]) -> Any:
        """The script's reply; raises what the store's ``call`` raises."""
        if not self._busy:
            self._busy = True
            try:
                return await self._call(lambda: script(keys=keys, args=args))
            finally:
                self._busy = False
                self._kick()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_consume)  # its caller may be gone (cancelled) by then
        self._queue.append(_Pending(script, keys, args, fut))
        return await asyncio.shield(fut)

    def _kick(self) -> None:
        if self._queue and not self._busy:
            self._busy = True
            task = asyncio.get_running_loop().create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                await self._send(batch)
        finally:
            self._busy = False
            self._kick()  # a call queued between the last send and here

    async def _send(self, batch: list[_Pending]) -> None:
        async def pipelined() -> list[Any]:
            async with self._r.pipeline(transaction=False) as p:
                for c in batch:
                    p.evalsha(c.script.sha, len(c.keys), *c.keys, *c.args)
                return list(await p.execute(raise_on_error=False))

        try:
            replies = await self._call(pipelined)
        except Exception as e:
            for c in batch:
                _settle(c.future, exc=e)
            return
        except BaseException:  # this task was cancelled (loop shutdown): so are the calls
            for c in batch:
                c.future.cancel()
            raise
        for c, reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError):
                await self._alone(c)
            elif isinstance(reply, Exception):
                err = self._translate(reply)
                err.__cause__ = reply
                _settle(c.future, exc=err)
            else:
                _settle(c.future, result=reply)

    async def _alone(self, c: _Pending) -> None:
        """One call again on its own: redis-py's script call loads a script Redis forgot."""

        def again() -> Awaitable[Any]:
            return c.script(keys=c.keys, args=c.args)

        try:
            _settle(c.future, result=await self._call(again))
        except Exception as e:
            _settle(c.future, exc=e)


def _settle(fut: asyncio.Future[Any], *, result: Any = None, exc: Exception | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
