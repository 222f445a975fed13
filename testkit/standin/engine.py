"""The simulated engine of one stand-in replica (no HTTP here; :mod:`testkit.standin.server`).

**Time model** (:class:`TimeModel`). Every running request advances at
``min(request_tokens_per_s, replica_tokens_per_s / running)`` tokens per second (a missing rate
is unlimited; with both missing a request completes the moment it is scheduled). Progress is
piecewise linear between events (a request arrives or ends, a pause, a label change, a reload),
so a request costs a handful of timer callbacks however long it is; a streamed request gets its
new tokens every ``stream_interval_s`` (one chunk may carry several tokens). At most
``max_running`` requests run; the rest wait (``vllm:num_requests_waiting``).

**vLLM 0.32 semantics modelled** (``shared/reference/vllm-api.md`` §1, §2, §4):

* pause ``abort`` ends every request (running and waiting) with ``finish_reason="abort"``;
  ``wait`` keeps running requests going and completes when none is left; ``keep`` freezes them.
  In all three modes requests submitted or waiting are *queued* and run after :meth:`resume`.
  With ``clear_cache`` the completed pause resets the prefix cache, preempting frozen requests
  (they are re-prefilled on resume).
* the weight label: every token is stamped with the label current when it was generated, and a
  label change opens a new span, so a ``keep`` pause across an update yields two spans.
* :meth:`reset_prefix_cache` answers ``False`` while a running or frozen request holds KV blocks.
* the prefix cache: 128-token blocks chained by hash (``cache_salt`` mixed into the first),
  LRU-bounded, counted in ``prefix_cache_queries``/``hits`` when a request is (re)scheduled;
  hits are capped at ``(len - 1) // block`` blocks. Each block remembers the weights that
  computed it: a request that reuses blocks of other weights ("stale KV") generates tokens that
  belong to neither checkpoint, as the real server does (``vllm-cpu.md`` §5).
* a reload swaps the weights in place: requests that still hold KV continue on the new weights
  with their stale KV. While the transfer runs nothing progresses (:meth:`block`).
* ``generation_tokens`` counts each token when it is made (vLLM counts them per engine step), so
  it stands still while requests are frozen.
* the ``running``/``waiting`` gauges are published by engine steps only: while the engine is
  paused and idle (or frozen by ``keep``) they keep the values of the moment the pause completed,
  and requests queued while paused are not counted (as observed on vLLM 0.32).

Everything runs on the event loop of the caller; no method blocks. ``clock`` (default: the
loop's) can be replaced in tests, which then drive time with :meth:`update`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from testkit.standin.weights import Weights, plan_tokens, prompt_key

__all__ = ["EngineDead", "PauseMode", "SimEngine", "SimRequest", "TimeModel"]

PauseMode = Literal["abort", "wait", "keep"]
_EPS = 1e-9


class TimeModel(BaseModel):
    """How fast a stand-in replica is. All fields may be changed at runtime."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_tokens_per_s: float | None = Field(default=None, gt=0)
    replica_tokens_per_s: float | None = Field(default=None, gt=0)
    #: seconds a ``reload_weights`` RPC takes (the engine does not step meanwhile)
    transfer_s: float = Field(default=0.0, ge=0)
    #: seconds from (re)start until the port accepts connections
    startup_s: float = Field(default=0.0, ge=0)
    stream_interval_s: float = Field(default=0.02, gt=0)

    def rate(self, running: int) -> float:
        """Tokens per second of each of ``running`` requests (``inf``: instant)."""
        per_request = self.request_tokens_per_s or math.inf
        if self.replica_tokens_per_s is None or running == 0:
            return per_request
        return min(per_request, self.replica_tokens_per_s / running)


class EngineDead(Exception):
    """The replica died (fault ``die``, or a request after a failed reload)."""


class SimRequest:
    """One sequence (one choice of one prompt). Read by the HTTP layer, written by the engine.

    ``tokens``/``spans`` grow as the request runs; ``finish_reason`` is set once at the end
    (``length``, ``stop`` or ``abort``); ``dead`` if the engine died under it. ``changed`` is
    set whenever new tokens or the end are available (the requests of one HTTP call may share
    one event).
    """

    __slots__ = (
        "changed",
        "dead",
        "end",
        "finish_reason",
        "holds_blocks",
        "ignore_eos",
        "max_tokens",
        "nonce",
        "num_cached",
        "plan",
        "plan_key",
        "plan_start",
        "prefilled",
        "progress",
        "prompt",
        "prompt_digest",
        "request_id",
        "salt",
        "spans",
        "stale",
        "stream",
        "tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        nonce: bytes = b"",
        salt: str | None = None,
        stream: bool = False,
        changed: asyncio.Event | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = tuple(prompt)
        self.prompt_digest = prompt_key(self.prompt)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.nonce = nonce
        self.salt = salt
        self.stream = stream
        self.tokens: list[int] = []
        self.spans: list[list[str | int]] = []  # [label, start, end)
        self.finish_reason: str | None = None
        self.dead = False
        self.progress = 0.0
        self.end = max_tokens
        self.plan: list[int] = []
        self.plan_start = 0
        self.plan_key = b""
        self.stale = b""
        self.prefilled = False
        self.holds_blocks = False
        self.num_cached = 0
        self.changed = changed or asyncio.Event()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.dead


class SimEngine:
    """The engine of one replica: see the module docstring for what it models."""

    def __init__(
        self,
        weights: Weights,
        *,
        time: TimeModel | None = None,
        max_running: int = 256,
        block_size: int = 128,
        cache_blocks: int = 256,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.weights = weights
        self.time = time or TimeModel()
        self.max_running = max_running
        self.block_size = block_size
        self.cache_blocks = cache_blocks
        self.label = "default"
        self.pause_mode: PauseMode | None = None
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.dead = False
        self.blocked = False
        # prometheus counters and the published gauges (running, waiting)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.gauges = (0, 0)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._pausers: list[tuple[asyncio.Future[None], bool]] = []
        self._clock = clock or asyncio.get_running_loop().time
        self._last = self._clock()
        self._timer: asyncio.TimerHandle | None = None

    # -- requests -----------------------------------------------------------------------------

    def submit(self, requests: Iterable[SimRequest]) -> None:
        """Queue requests (they run at once unless paused or over ``max_running``)."""
        if self.dead:
            raise EngineDead("the engine is dead")
        for r in requests:
            self.prompt_tokens += len(r.prompt)
            self.waiting.append(r)
        self.update()

    def abort(self, requests: Iterable[SimRequest]) -> int:
        """End these requests with ``abort`` (those already finished are skipped)."""
        self._advance(self._clock())
        n = 0
        for r in requests:
            if not r.done:
                self._finish(r, "abort")
                n += 1
        self.update()
        return n

    def abort_all(self) -> int:
        return self.abort([*self.running, *self.waiting])

    # -- control ------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    def pause(self, mode: PauseMode, clear_cache: bool) -> asyncio.Future[None]:
        """Pause; the future completes when the pause does (``wait``: once nothing runs)."""
        self._advance(self._clock())
        if mode == "abort":
            for r in [*self.running, *self.waiting]:
                self._finish(r, "abort")
        self.pause_mode = mode
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pausers.append((fut, clear_cache))
        self.update()
        return fut

    def resume(self) -> None:
        self._advance(self._clock())
        self.pause_mode = None
        self.update()

    def set_label(self, label: str) -> None:
        self._advance(self._clock())
        self.label = label

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the prefix cache; ``False`` (nothing done) while a request holds KV blocks,
        unless ``reset_running_requests`` preempts them first (they are re-prefilled)."""
        self._advance(self._clock())
        if reset_running_requests:
            self._preempt_all()
        elif any(r.holds_blocks for r in self.running):
            return False
        self._cache.clear()
        self.update()
        return True

    def block(self) -> None:
        """A utility call that occupies the engine loop starts (e.g. a weight transfer)."""
        self._advance(self._clock())
        self.blocked = True
        self.update()

    def unblock(self) -> None:
        self._last = self._clock()  # no progress was made while blocked
        self.blocked = False
        self.update()

    def swap_weights(self, weights: Weights) -> None:
        """Load ``weights`` in place. Requests holding KV keep it (now stale)."""
        self._advance(self._clock())
        old = self.weights.identity
        for r in self.running:
            if r.holds_blocks:
                r.stale = _join(r.stale, old)
        self.weights = weights
        for r in self.running:
            if r.prefilled:
                self._plan(r)
        self.update()

    def set_time(self, time: TimeModel) -> None:
        """New rates from now on (progress so far was made at the old ones)."""
        self._advance(self._clock())
        self.time = time
        self.update()

    def kill(self) -> None:
        """The process died: every request ends without an answer; nothing runs again."""
        self.dead = True
        if self._timer is not None:
            self._timer.cancel()
        for r in [*self.running, *self.waiting]:
            r.dead = True
            r.changed.set()
        self.running.clear()
        self.waiting.clear()
        for fut, _ in self._pausers:
            if not fut.done():
                fut.set_exception(EngineDead("the engine died"))
        self._pausers.clear()

    # -- the step -----------------------------------------------------------------------------

    def update(self) -> None:
        """Advance to now, schedule, complete pauses, publish gauges, re-arm the timer."""
        if self.dead:
            return
        self._advance(self._clock())
        if self.pause_mode is None and not self.blocked:
            for r in self.running:
                if not r.prefilled:
                    self._prefill(r)
            while self.waiting and len(self.running) < self.max_running:
                r = self.waiting.popleft()
                self.running.append(r)
                self._prefill(r)
        active = self._active()
        if active and math.isinf(self.time.rate(len(active))):
            for r in active:
                r.progress = r.end
                self._materialize(r)
            active = self._active()
        if self.pause_mode is None or active:
            self._publish()
        if self._pausers and not active and not self.blocked:
            self._complete_pauses()
        self._arm()

    def _active(self) -> list[SimRequest]:
        """The requests that make progress now (none while blocked or frozen by ``keep``)."""
        if self.blocked or self.pause_mode == "keep":
            return []
        return [r for r in self.running if r.prefilled]

    def _publish(self) -> None:
        """An engine step's gauges: preempted requests count as waiting, as in vLLM."""
        running = sum(1 for r in self.running if r.prefilled)
        self.gauges = (running, len(self.waiting) + len(self.running) - running)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        self._last = now
        active = self._active()
        if dt <= 0 or not active:
            return
        step = self.time.rate(len(active)) * dt
        for r in active:
            r.progress = min(r.end, r.progress + step)
            self._materialize(r)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        active = self._active()
        if not active:
            return
        rate = self.time.rate(len(active))
        if math.isinf(rate):
            return
        delay = min(r.end - r.progress for r in active) / rate
        if any(r.stream for r in active):
            delay = min(delay, self.time.stream_interval_s)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(delay, 1e-4), self.update)

    def _complete_pauses(self) -> None:
        pausers, self._pausers = self._pausers, []
        self._publish()  # the last step before the pause; frozen requests still count as running
        if any(clear for _, clear in pausers):
            self._preempt_all()
            self._cache.clear()
        for fut, _ in pausers:
            if not fut.done():
                fut.set_result(None)

    def _preempt_all(self) -> None:
        for r in self.running:
            if r.prefilled:
                self.preemptions += 1
            r.prefilled = False
            r.holds_blocks = False

    # -- prefill, tokens, finish ----------------------------------------------------------------

    def _prefill(self, r: SimRequest) -> None:
        """Schedule ``r``'s prompt (plus its tokens, after a preemption) through the cache."""
        seq = r.prompt + tuple(r.tokens)
        hits, stale = self._cache_lookup(seq, r.salt)
        self.prefix_queries += len(seq)
        self.prefix_hits += hits
        r.num_cached = hits
        r.stale = stale
        r.prefilled = r.holds_blocks = True
        self._cache_insert(seq, r.salt, self._kv_identity(r))
        self._plan(r)

    def _kv_identity(self, r: SimRequest) -> bytes:
        ident = self.weights.identity
        return ident if not r.stale else hashlib.blake2b(ident + r.stale, digest_size=16).digest()

    def _plan(self, r: SimRequest) -> None:
        """(Re)plan ``r``'s remaining tokens if the weights or its stale KV changed."""
        key = self.weights.identity + r.stale
        if key == r.plan_key:
            return
        start = len(r.tokens)
        remaining = r.max_tokens - start
        r.plan = plan_tokens(
            self.weights, r.prompt_digest, start, remaining, nonce=r.nonce, stale=r.stale
        )
        r.plan_start, r.plan_key = start, key
        eos = self.weights.eos_token_id
        if not r.ignore_eos and eos is not None and eos in r.plan:
            remaining = r.plan.index(eos) + 1
        r.end = start + remaining

    def _materialize(self, r: SimRequest) -> None:
        n = min(int(r.progress + _EPS), r.end)
        if n > len(r.tokens):
            self._plan(r)
            n = min(n, r.end)
            label = self.label
            start = len(r.tokens)
            r.tokens.extend(r.plan[start - r.plan_start : n - r.plan_start])
            self.generation_tokens += n - start  # counted as sampled, as vLLM's steps do
            if r.spans and r.spans[-1][0] == label:
                r.spans[-1][2] = n
            else:
                r.spans.append([label, start, n])
            if r.stream:
                r.changed.set()
        if len(r.tokens) >= r.end:
            eos = self.weights.eos_token_id
            stop = len(r.tokens) < r.max_tokens or (not r.ignore_eos and r.tokens[-1] == eos)
            self._finish(r, "stop" if stop else "length")

    def _finish(self, r: SimRequest, reason: str) -> None:
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
        if r.holds_blocks:
            self._cache_insert(r.prompt + tuple(r.tokens), r.salt, self._kv_identity(r))
            r.holds_blocks = False
        r.finish_reason = reason
        r.changed.set()

    # -- the prefix cache ---------------------------------------------------------------------

    def _blocks(self, seq: Sequence[int], salt: str | None) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        h = hash(salt)
        for i in range(len(seq) // bs):
            h = hash((h, *seq[i * bs : (i + 1) * bs]))
            out.append(h)
        return out

    def _cache_lookup(self, seq: Sequence[int], salt: str | None) -> tuple[int, bytes]:
        """(cached tokens usable by ``seq``, joined identities of other weights among them)."""
        limit = (len(seq) - 1) // self.block_size
        current = self.weights.identity
        stale = b""
        n = 0
        for h in self._blocks(seq, salt)[:limit]:
            ident = self._cache.get(h)
            if ident is None:
                break
            self._cache.move_to_end(h)
            if ident != current:
                stale = _join(stale, ident)
            n += 1
        return n * self.block_size, stale

    def _cache_insert(self, seq: Sequence[int], salt: str | None, ident: bytes) -> None:
        for h in self._blocks(seq, salt):
            if h in self._cache:
                self._cache.move_to_end(h)
            else:
                self._cache[h] = ident
        while len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)


def _join(stale: bytes, ident: bytes) -> bytes:
    """The sorted, duplicate-free concatenation of 16-byte identities."""
    parts = {stale[i : i + 16] for i in range(0, len(stale), 16)} | {ident}
    return b"".join(sorted(parts))
