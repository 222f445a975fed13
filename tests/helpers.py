"""Reads and shortcuts only tests need (product code has no use for them)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from pool.store import RedisStore
from pool.types import Generation, ReplicaState
from testkit.standin import StandinReplica, TimeModel
from testkit.standin.engine import SimRequest

#: what a completion generates when its body does not say (vLLM's default ``max_tokens``)
DEFAULT_TOKENS = 16


async def begin_drain(
    store: RedisStore, replica_id: str, token: int, target: Generation, identity: str
) -> int:
    """READY -> DRAINING towards ``target``, as the cycle's DrainRequested commits it."""
    return await store.transition(
        replica_id,
        token,
        ReplicaState.READY,
        ReplicaState.DRAINING,
        reason=f"update to {target.label}",
        target=target,
        target_identity=identity,
    )


async def active_rollouts(store: RedisStore, replica_id: str) -> set[str]:
    """The ids of the bindings active on ``replica_id``."""
    ids: set[str] = await store.r.smembers(store.k.active(replica_id))
    return ids


async def generation_outcomes(store: RedisStore) -> dict[int, dict[str, int]]:
    """Rollouts ended per generation number and final state (counted by RELEASE)."""
    raw = await store.r.hgetall(store.k.gen_outcomes)
    out: dict[int, dict[str, int]] = {}
    for field, n in raw.items():
        gen, _, state = str(field).partition(":")
        out.setdefault(int(gen), {})[state] = int(n)
    return out


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait for a condition (polled: the event is another process's or Redis's)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def taking(replica: StandinReplica, seconds: float, tokens: int = DEFAULT_TOKENS) -> None:
    """Make a stand-in request of ``tokens`` tokens take ``seconds`` on ``replica``."""
    replica.set_time(TimeModel(request_tokens_per_s=tokens / seconds))


async def generating(replica: StandinReplica, count: int = 1) -> list[SimRequest]:
    """The sequences ``replica`` generates, once it has at least ``count`` of them."""
    engine = replica.live_engine()

    async def enough() -> bool:
        return len(engine.running) >= count

    await until(enough)
    return list(engine.running)


async def aborted(generation: SimRequest) -> None:
    """Wait until the stand-in aborted ``generation``: its HTTP client (the router) went away."""

    async def ended() -> bool:
        return generation.finish_reason == "abort"

    await until(ended)


async def idle(replica: StandinReplica) -> None:
    """Wait until ``replica`` generates nothing (every request answered or aborted)."""
    engine = replica.live_engine()

    async def nothing() -> bool:
        return not engine.running and not engine.waiting

    await until(nothing)


async def queued(replica: StandinReplica, count: int = 1) -> None:
    """Wait until at least ``count`` sequences wait on ``replica`` (behind a pause)."""
    engine = replica.live_engine()

    async def waiting() -> bool:
        return len(engine.waiting) >= count

    await until(waiting)


#: Sockets that hold the ports :func:`refused_port` hands out, for the test process's lifetime.
_HELD: list[socket.socket] = []


def refused_port() -> int:
    """A local port whose connections are refused for as long as this process lives.

    The port is bound here and never listened on, so no other process can take it: a port that
    was merely free when asked (``free_port``) can be taken by a server another test starts
    meanwhile, and a test that expected "unreachable" then talks to that server.
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    port: int = s.getsockname()[1]
    return port


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter from the checkout's root (nothing this process imported
    or cached carries over) and return its stdout; fails the test on a non-zero exit."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    return out.stdout


async def generate_tokens(
    url: str, model: str | None, token_ids: list[int], sampling_params: dict[str, object]
) -> dict[str, Any]:
    """``POST /inference/v1/generate`` (vLLM with ``--enable-scale-out``): the one choice, with
    its ``token_ids`` and, from 0.32, its ``weight_versions`` spans."""
    body: dict[str, object] = {"token_ids": token_ids, "sampling_params": sampling_params}
    if model is not None:
        body["model"] = model
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        r = await c.post("/inference/v1/generate", json=body)
    r.raise_for_status()
    [choice] = r.json()["choices"]
    return dict(choice)
