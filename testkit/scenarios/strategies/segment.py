"""One strategy segment of the strategies benchmark, on replicas that are already running.

:func:`run_segment`: every replica back on policy 0 (:func:`.drivers.prepare_replicas`), the
pool's processes started if the strategy is a pool one, then the clients saturate the replicas
for ``warmup_s`` (the steady state, no update) and the trainer runs ``steps`` steps
(:func:`.workload.trainer`); the measuring window is from the trainer's start to its last
step's end. Meanwhile every replica's ``vllm:generation_tokens_total`` is scraped every
``metrics_every_s`` (what the engines really generated, per replica, whoever asked) and, for the
pool, its admitting fraction. Returns the raw :class:`Segment`; :mod:`.report` reduces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pool.engine import VllmEngine
from testkit.scenarios.strategies.drivers import (
    BASELINES,
    POOLS,
    DirectTarget,
    PoolStack,
    PoolTarget,
    Timeline,
    baseline_publish,
    prepare_replicas,
)
from testkit.scenarios.strategies.workload import Book, Load, Target, trainer

__all__ = ["Params", "Segment", "rolling_k", "run_segment"]

_GEN_TOKENS = re.compile(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)", re.MULTILINE)


@dataclass
class Params:
    """The workload and the trainer (the same for every strategy of a run)."""

    concurrency: int = 16
    max_tokens: int = 192
    eos_prob: float = 1 / 48
    session_share: float = 0.25
    session_turns: int = 2
    steps: int = 3
    train_s: float = 3.0
    batch: int = 16
    warmup_s: float = 6.0
    metrics_every_s: float = 0.5
    admitting_every_s: float = 0.2
    wait_timeout_s: float = 300.0


def rolling_k(strategy: str, n: int) -> int:
    """The pool's ``max_unavailable`` and ``first_wave`` (its own choice). Strict: N, every
    replica drains and updates at once, each on its own and back as soon as it is ready, the
    first ready one publishing (with ``max_staleness`` 0 publishing g+1 closes every replica
    still on g anyway, so a first replica alone, then the rest, would leave the pool idle for
    two windows, where stop-the-world idles it for one). At ``max_staleness`` 1: waves of N/8
    (at least 1), the first replica alone, the replicas on g admitting meanwhile."""
    return n if strategy == "pool_strict" else max(1, n // 8)


@dataclass
class Segment:
    """What one segment recorded (monotonic times)."""

    strategy: str
    replicas: int
    t_warm: float
    t0: float
    t1: float
    book: Book
    timeline: Timeline
    #: (t, replica index, generation_tokens_total)
    tokens: list[tuple[float, int, float]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    retries_503: int = 0
    retries_session_busy: int = 0
    error: str = ""
    logs: dict[str, str] = field(default_factory=dict)


async def _scrape(
    http: aiohttp.ClientSession,
    url: str,
    i: int,
    out: list[tuple[float, int, float]],
    stop: asyncio.Event,
    every_s: float,
) -> None:
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
            t = time.monotonic()
            values = [float(m) for m in _GEN_TOKENS.findall(text)]
            if values:
                out.append((t, i, sum(values)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def served_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/v1/models") as r:
        data = await r.json()
    return str(data["data"][0]["id"])


async def run_segment(strategy: str, urls: list[str], p: Params, work: Path, seed: int) -> Segment:
    """Run ``strategy`` for one segment on the replicas at ``urls``; see the module docstring.
    A failure is recorded in :attr:`Segment.error` (with the pool's logs), not raised."""
    if strategy not in BASELINES + POOLS:
        raise ValueError(f"unknown strategy {strategy}")
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    engines = [VllmEngine(u, timeout=600.0) for u in urls]
    book, timeline = Book(), Timeline()
    seg = Segment(strategy, len(urls), 0.0, 0.0, 0.0, book, timeline)
    stack: PoolStack | None = None
    stop = asyncio.Event()
    bg: list[asyncio.Task[None]] = []
    follows: list[asyncio.Task[None]] = []
    load_task: asyncio.Task[None] | None = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        try:
            for e in engines:
                await e.bootstrap()
            await prepare_replicas(engines, p.eos_prob)
            target: Target
            if strategy in POOLS:
                k = rolling_k(strategy, len(urls))
                stack = PoolStack(
                    urls,
                    work / f"{strategy}-{seed}",
                    max_staleness=1 if strategy == "pool_staleness1" else 0,
                    max_unavailable=k,
                    first_wave=k if strategy == "pool_strict" else 1,
                    eos_prob=p.eos_prob,
                )
                seg.settings = stack.settings
                await stack.start(http)
                target = PoolTarget(stack.router_url)
            else:
                model = await served_model(http, urls[0])
                target = DirectTarget(
                    urls,
                    model,
                    resubmit=strategy == "abort_resubmit",
                    spans=engines[0].capabilities.spans_generate,
                )
            load = Load(
                target, book, p.concurrency, p.max_tokens, p.session_share, p.session_turns, seed
            )
            bg += [
                asyncio.create_task(_scrape(http, u, i, seg.tokens, stop, p.metrics_every_s))
                for i, u in enumerate(urls)
            ]
            if stack is not None:
                bg.append(
                    asyncio.create_task(
                        stack.sample_admitting(http, timeline, stop, p.admitting_every_s)
                    )
                )
            load_task = asyncio.create_task(load.run(http))
            seg.t_warm = time.monotonic()
            await asyncio.sleep(p.warmup_s)
            seg.t0 = time.monotonic()
            if isinstance(target, DirectTarget):
                publish = baseline_publish(strategy, engines, load, target, timeline, p.eos_prob)
            else:
                assert stack is not None
                publish = stack.publish(http, timeline, follows)
            await trainer(
                book,
                publish,
                steps=p.steps,
                train_s=p.train_s,
                batch=p.batch,
                wait_timeout_s=p.wait_timeout_s,
            )
            seg.t1 = time.monotonic()
            load.stop.set()
            load.gate.set()
            try:
                await asyncio.wait_for(load_task, 180)
            except TimeoutError:
                book.error("load did not end within 180 s")
            if follows:
                await asyncio.wait_for(asyncio.gather(*follows), 300)
            if isinstance(target, PoolTarget):
                seg.retries_503 = target.retries_503
                seg.retries_session_busy = target.retries_session_busy
        except Exception as e:  # recorded in the row; the run goes on
            seg.error = f"{type(e).__name__}: {e}"
            if stack is not None:
                seg.logs = stack.logs()
        finally:
            stop.set()
            tasks = [*bg, *follows, *([load_task] if load_task is not None else [])]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if stack is not None:
                await asyncio.to_thread(stack.stop)
            for engine in engines:
                await engine.aclose()
    return seg
