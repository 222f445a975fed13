"""Async HTTP client for one vLLM server's control plane (vLLM 0.26 - 0.33, CPU or GPU).

:class:`VllmEngine` wraps the dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) that RolloutPool
needs and returns typed evidence (:mod:`pool.evidence`) or the small frozen values of
:mod:`pool.engine_values` (exported here too).
Call :meth:`VllmEngine.bootstrap` first: it reads ``GET /version`` and records
:class:`Capabilities`, which decide what the version-dependent calls do (0.26 has no weight
labels, for instance).

**Deadlines.** Every method takes ``timeout_s`` (seconds; ``None`` means the engine's default
``timeout`` given to the constructor). It bounds the whole HTTP exchange (connect, send, wait,
read), so no call blocks longer than its ``timeout_s``. :meth:`VllmEngine.reset_caches` makes
several calls; its bound is stated there. ``POST /pause?mode=wait`` holds the call open until
in-flight requests finish: give it a timeout that covers the longest generation to wait for.

**Errors are translated at this seam** (as httpx maps httpcore errors), into
:class:`~pool.errors.EngineError` subclasses whose ``context`` carries ``method``, ``path``,
``url``, ``status`` and a ``body`` excerpt where known:

================================================  ==================  ====================
what happened                                     read-only call      mutating call
================================================  ==================  ====================
connection refused / connect timeout (not sent)   ``NoMutation``      ``NoMutation``
HTTP 4xx (request refused)                        ``NoMutation``      ``NoMutation``
timeout after sending, read error, reset          ``NoMutation``      ``AmbiguousMutation``
HTTP 5xx, or a 2xx body that is not as expected   ``NoMutation``      ``AmbiguousMutation``
================================================  ==================  ====================

A read-only call (``GET``\\s, completions) cannot mutate weights or caches, so every failure of
one is ``NoMutation`` (the caller decides whether an unresponsive engine matters). Mutating calls
are ``pause``, ``resume``, the cache resets, ``set_label``, ``abort_requests`` and
``collective_rpc``. Keep-alive is disabled: after a 500, vLLM's server closes the connection, and
reusing a pooled connection then fails with a read error that would look ambiguous although the
request was never sent.

``{"success": false}`` from ``/reset_prefix_cache`` is **not** an error: it is retried a bounded
number of times and then reported in :class:`~pool.evidence.CacheResetEvidence` with
``prefix=False``, which the lifecycle controller refuses.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx

from pool.engine_values import (
    AbortResult,
    Capabilities,
    EngineMetrics,
    RpcResult,
    WorldSize,
    parse_version,
)
from pool.errors import AmbiguousMutation, EngineError, NoMutation
from pool.evidence import CacheResetEvidence, LabelEvidence, PauseEvidence, ResumeEvidence

__all__ = [
    "AbortResult",
    "Capabilities",
    "EngineMetrics",
    "PauseMode",
    "RpcResult",
    "VllmEngine",
    "WorldSize",
    "parse_version",
]

PauseMode = Literal["abort", "wait", "keep"]

_BODY_EXCERPT = 500


_START_TIME = re.compile(r"^process_start_time_seconds(?:\{[^}]*\})? (\S+)", re.MULTILINE)


class VllmEngine:
    """Control-plane client of one vLLM server at ``url``.

    ``timeout`` is the default deadline of each call in seconds. ``transport`` replaces the
    network (tests pass :class:`httpx.MockTransport`). Use ``async with`` or call
    :meth:`aclose`. Methods may run concurrently; each is one or a few independent HTTP calls.
    """

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout,
            limits=httpx.Limits(max_keepalive_connections=0),
            transport=transport,
        )
        self._caps: Capabilities | None = None
        self.model_id: str | None = None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> VllmEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def capabilities(self) -> Capabilities:
        """The capabilities read by :meth:`bootstrap` (``RuntimeError`` before it ran)."""
        if self._caps is None:
            raise RuntimeError(f"VllmEngine({self.url}): call bootstrap() first")
        return self._caps

    # -- the seam -----------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        mutating: bool,
        timeout_s: float | None,
        json: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One HTTP exchange bounded by ``timeout_s``; failures mapped per the module table."""
        limit = self.timeout if timeout_s is None else timeout_s
        ctx: dict[str, Any] = {"method": method, "path": path, "url": self.url, "timeout_s": limit}
        unsure = AmbiguousMutation if mutating else NoMutation
        try:
            async with asyncio.timeout(limit):
                r = await self._client.request(
                    method, path, json=json, params=params, timeout=limit
                )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            raise NoMutation(
                f"{method} {path}: request not sent ({type(e).__name__}: {e})", sent=False, **ctx
            ) from e
        except (httpx.TimeoutException, TimeoutError) as e:
            raise unsure(
                f"{method} {path}: no complete answer within {limit}s", timed_out=True, **ctx
            ) from e
        except httpx.TransportError as e:
            raise unsure(
                f"{method} {path}: transport failed ({type(e).__name__}: {e})", **ctx
            ) from e
        if r.is_success:
            return r
        ctx.update(status=r.status_code, body=r.text[:_BODY_EXCERPT])
        msg = f"{method} {path}: HTTP {r.status_code}: {r.text[:_BODY_EXCERPT]}"
        if r.status_code < 500:
            raise NoMutation(msg, **ctx)
        raise unsure(msg, **ctx)

    def _body(self, r: httpx.Response, *, mutating: bool) -> dict[str, Any]:
        """The JSON object body of a 2xx response; anything else is an error (see the table)."""
        try:
            body = r.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            return body
        req = r.request
        cls = AmbiguousMutation if mutating else NoMutation
        raise cls(
            f"{req.method} {req.url.path}: expected a JSON object, got: {r.text[:_BODY_EXCERPT]!r}",
            method=req.method,
            path=req.url.path,
            url=self.url,
            status=r.status_code,
            body=r.text[:_BODY_EXCERPT],
        )

    def _unexpected(self, r: httpx.Response, what: str, *, mutating: bool) -> EngineError:
        req = r.request
        cls = AmbiguousMutation if mutating else NoMutation
        return cls(
            f"{req.method} {req.url.path}: {what}: {r.text[:_BODY_EXCERPT]}",
            method=req.method,
            path=req.url.path,
            url=self.url,
            status=r.status_code,
            body=r.text[:_BODY_EXCERPT],
        )

    # -- discovery ----------------------------------------------------------------------------

    async def bootstrap(self, *, timeout_s: float | None = None) -> Capabilities:
        """Read ``/version`` (-> :class:`Capabilities`) and the served model id (``/v1/models``).

        Read-only; raises ``NoMutation`` if the server is unreachable or answers oddly.
        """
        r = await self._call("GET", "/version", mutating=False, timeout_s=timeout_s)
        version = self._body(r, mutating=False).get("version")
        if not isinstance(version, str):
            raise self._unexpected(r, "no version string", mutating=False)
        try:
            caps = Capabilities.from_version(version)
        except ValueError as e:
            raise self._unexpected(r, str(e), mutating=False) from e
        r = await self._call("GET", "/v1/models", mutating=False, timeout_s=timeout_s)
        data = self._body(r, mutating=False).get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict):
            model_id = data[0].get("id")
            self.model_id = model_id if isinstance(model_id, str) else None
        self._caps = caps
        return caps

    async def health(self, *, timeout_s: float | None = 5.0) -> bool:
        """True iff ``GET /health`` answers 200. Never raises. 200 does NOT prove the engine can
        serve (it stays 200 with workers hung in NCCL); use :meth:`complete` for that."""
        try:
            await self._call("GET", "/health", mutating=False, timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    # -- pause / resume -----------------------------------------------------------------------

    async def pause(
        self,
        mode: PauseMode = "wait",
        *,
        clear_cache: bool | None = None,
        timeout_s: float | None = None,
    ) -> PauseEvidence:
        """``POST /pause?mode=...`` then read back ``GET /is_paused``.

        ``wait`` blocks until running requests finish; ``abort`` ends them (they return
        ``finish_reason="abort"``); ``keep`` freezes them. ``clear_cache=None`` leaves vLLM's
        default (true: prefix cache cleared at pause). On a timeout or 5xx the engine may or may
        not be paused (``AmbiguousMutation``); the pause itself keeps running server-side. If the
        pause succeeded but the read-back fails, that is ``AmbiguousMutation`` too.
        """
        params: dict[str, str] = {"mode": mode}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        t0 = time.monotonic()
        r = await self._call("POST", "/pause", mutating=True, timeout_s=timeout_s, params=params)
        elapsed = time.monotonic() - t0
        if self._body(r, mutating=True).get("status") != "paused":
            raise self._unexpected(r, "pause did not report status=paused", mutating=True)
        paused = await self._read_back_paused("POST /pause")
        return PauseEvidence(
            mode=mode, http_status=r.status_code, is_paused=paused, elapsed_s=elapsed
        )

    async def resume(self, *, timeout_s: float | None = None) -> ResumeEvidence:
        """``POST /resume`` then read back ``GET /is_paused``."""
        t0 = time.monotonic()
        r = await self._call("POST", "/resume", mutating=True, timeout_s=timeout_s)
        elapsed = time.monotonic() - t0
        if self._body(r, mutating=True).get("status") != "resumed":
            raise self._unexpected(r, "resume did not report status=resumed", mutating=True)
        paused = await self._read_back_paused("POST /resume")
        return ResumeEvidence(http_status=r.status_code, is_paused=paused, elapsed_s=elapsed)

    async def _read_back_paused(self, after: str) -> bool:
        """``is_paused`` after a mutation succeeded: a failure here is ambiguous, not NoMutation."""
        try:
            return await self.is_paused()
        except EngineError as e:
            raise AmbiguousMutation(
                f"{after} succeeded but reading back /is_paused failed: {e.message}",
                **{**e.context, "after": after},
            ) from e

    async def confirm_resumed(self, *, timeout_s: float | None = None) -> ResumeEvidence:
        """``GET /is_paused`` on an engine resumed earlier and the serving process's identity
        (``/metrics``), both at once: evidence that this process, unpaused, serves
        (read-only)."""
        t0 = time.monotonic()
        r, process = await asyncio.gather(
            self._call("GET", "/is_paused", mutating=False, timeout_s=timeout_s),
            self.process_identity(timeout_s=timeout_s),
        )
        value = self._body(r, mutating=False).get("is_paused")
        if not isinstance(value, bool):
            raise self._unexpected(r, "is_paused is not a boolean", mutating=False)
        return ResumeEvidence(
            http_status=r.status_code,
            is_paused=value,
            elapsed_s=time.monotonic() - t0,
            process=process,
        )

    async def process_identity(self, *, timeout_s: float | None = None) -> str | None:
        """The serving process's identity (:attr:`EngineMetrics.process`) from ``/metrics``,
        found without parsing the whole scrape (the supervisor asks every health round). The
        scrape is first asked for that one metric (prometheus_client's ``name[]`` filter: a
        full vLLM scrape takes milliseconds to render), then, where the answer lacks it (a
        server without the filter, a multiprocess registry), in full."""
        m = None
        for params in ({"name[]": "process_start_time_seconds"}, None):
            r = await self._call(
                "GET", "/metrics", mutating=False, timeout_s=timeout_s, params=params
            )
            m = _START_TIME.search(r.text)
            if m is not None:
                break
        if m is None:
            return None
        try:
            return EngineMetrics(0, 0, 0, 0, float(m[1])).process
        except ValueError as e:
            raise self._unexpected(r, f"unparsable process_start_time ({e})", mutating=False) from e

    async def is_paused(self, *, timeout_s: float | None = None) -> bool:
        """``GET /is_paused`` -> the ``is_paused`` field (read-only)."""
        r = await self._call("GET", "/is_paused", mutating=False, timeout_s=timeout_s)
        value = self._body(r, mutating=False).get("is_paused")
        if not isinstance(value, bool):
            raise self._unexpected(r, "is_paused is not a boolean", mutating=False)
        return value

    # -- caches -------------------------------------------------------------------------------

    async def reset_caches(
        self,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        reset_running_requests: bool = False,
        timeout_s: float | None = None,
    ) -> CacheResetEvidence:
        """Reset the prefix cache (checking the body), the multimodal and the encoder caches,
        the three at once (independent caches; one round trip instead of three in a row).

        ``/reset_prefix_cache`` answers ``{"success": false}`` while KV blocks are in use; that
        is retried up to ``retries`` attempts in all, sleeping ``backoff_s * 2**k`` (capped at
        2 s) between them, then reported as ``prefix=False`` (not raised). The mm and encoder
        resets answer an empty 200, which is all they prove. Worst-case duration:
        ``retries * timeout_s`` plus the sleeps. HTTP failures raise per the module table,
        except that a ``NoMutation`` of one reset while another may have run is
        ``AmbiguousMutation`` (``partial=True``): resets are idempotent, so retrying is safe.
        """
        if retries < 1:
            raise ValueError("retries must be >= 1")
        params = {"reset_running_requests": "true"} if reset_running_requests else None

        async def prefix_reset() -> int:
            """Attempts until success (0: never succeeded)."""
            for attempt in range(retries):
                r = await self._call(
                    "POST", "/reset_prefix_cache", mutating=True, timeout_s=timeout_s, params=params
                )
                success = self._body(r, mutating=True).get("success")
                if not isinstance(success, bool):
                    raise self._unexpected(r, "no boolean 'success' in the body", mutating=True)
                if success:
                    return attempt + 1
                if attempt + 1 < retries:
                    await asyncio.sleep(min(backoff_s * 2**attempt, 2.0))
            return 0

        done = await asyncio.gather(
            prefix_reset(),
            self._call("POST", "/reset_mm_cache", mutating=True, timeout_s=timeout_s),
            self._call("POST", "/reset_encoder_cache", mutating=True, timeout_s=timeout_s),
            return_exceptions=True,
        )
        errors = [e for e in done if isinstance(e, BaseException)]
        if errors:
            e = errors[0]
            if isinstance(e, NoMutation) and len(errors) < len(done):  # another reset ran
                raise AmbiguousMutation(
                    f"cache reset partly done: {e.message}", **{**e.context, "partial": True}
                ) from e
            raise e
        succeeded_at = done[0]
        assert isinstance(succeeded_at, int)
        prefix = succeeded_at > 0
        attempts = succeeded_at or retries
        detail = "" if prefix else f"prefix cache reset reported success=false {attempts} times"
        return CacheResetEvidence(
            prefix=prefix, multimodal=True, encoder=True, attempts=attempts, detail=detail
        )

    # -- labels -------------------------------------------------------------------------------

    async def weight_label(self, *, timeout_s: float | None = None) -> LabelEvidence:
        """``GET /weight_info`` -> the label; ``supported=False`` (no call) before 0.27."""
        if not self.capabilities.labels:
            return LabelEvidence(supported=False, label=None)
        r = await self._call("GET", "/weight_info", mutating=False, timeout_s=timeout_s)
        label = self._body(r, mutating=False).get("weight_version")
        if not isinstance(label, str):
            raise self._unexpected(r, "weight_version is not a string", mutating=False)
        return LabelEvidence(supported=True, label=label)

    async def set_label(self, label: str, *, timeout_s: float | None = None) -> LabelEvidence:
        """``POST /update_weight_version {"new_version": label}``; checks ``success``.

        Before 0.27 there are no labels: returns ``supported=False`` without a call. A body
        with ``success: false`` raises ``NoMutation`` (the server says it did not set it).
        Labels are opaque to vLLM and not checked against the weights.
        """
        if not self.capabilities.labels:
            return LabelEvidence(supported=False, label=None)
        r = await self._call(
            "POST",
            "/update_weight_version",
            mutating=True,
            timeout_s=timeout_s,
            json={"new_version": label},
        )
        body = self._body(r, mutating=True)
        if body.get("success") is False:
            raise NoMutation(
                f"POST /update_weight_version refused: {r.text[:_BODY_EXCERPT]}",
                method="POST",
                path="/update_weight_version",
                url=self.url,
                status=r.status_code,
                body=r.text[:_BODY_EXCERPT],
            )
        if body.get("success") is not True:
            raise self._unexpected(r, "no success=true in the body", mutating=True)
        new = body.get("new_version", label)
        return LabelEvidence(supported=True, label=new if isinstance(new, str) else label)

    # -- workers ------------------------------------------------------------------------------

    async def world_size(
        self, *, include_dp: bool = True, timeout_s: float | None = None
    ) -> WorldSize:
        """``GET /get_world_size?include_dp=...`` (read-only)."""
        params = {"include_dp": "true" if include_dp else "false"}
        r = await self._call(
            "GET", "/get_world_size", mutating=False, timeout_s=timeout_s, params=params
        )
        ws = self._body(r, mutating=False).get("world_size")
        if not isinstance(ws, int):
            raise self._unexpected(r, "world_size is not an integer", mutating=False)
        return WorldSize(world_size=ws, include_dp=include_dp)

    async def abort_requests(
        self, request_ids: Sequence[str] | None = None, *, timeout_s: float | None = None
    ) -> AbortResult:
        """``POST /abort_requests``: the given ids, or every request when ``None``."""
        body: dict[str, Any] = {} if request_ids is None else {"request_ids": list(request_ids)}
        r = await self._call(
            "POST", "/abort_requests", mutating=True, timeout_s=timeout_s, json=body
        )
        aborted = self._body(r, mutating=True).get("aborted", 0)
        return AbortResult(
            aborted=aborted if isinstance(aborted, int) else 0,
            requested=None if request_ids is None else tuple(request_ids),
        )

    async def collective_rpc(
        self,
        method: str,
        kwargs: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        *,
        rpc_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> RpcResult:
        """``POST /collective_rpc`` running ``method`` on every worker; blocks the engine loop.

        vLLM passes only strings as args/kwargs. ``rpc_timeout_s`` is vLLM's own timeout (sent in
        the body; none by default); ``timeout_s`` is this call's deadline. A worker exception is a
        500 -> ``AmbiguousMutation``. An empty 200 (no results) gives ``results=()``.
        """
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        if rpc_timeout_s is not None:
            body["timeout"] = rpc_timeout_s
        t0 = time.monotonic()
        r = await self._call(
            "POST", "/collective_rpc", mutating=True, timeout_s=timeout_s, json=body
        )
        elapsed = time.monotonic() - t0
        if not r.content:
            return RpcResult(method=method, results=(), elapsed_s=elapsed)
        results = self._body(r, mutating=True).get("results")
        if not isinstance(results, list):
            raise self._unexpected(r, "no 'results' list in the body", mutating=True)
        return RpcResult(method=method, results=tuple(results), elapsed_s=elapsed)

    # -- observation --------------------------------------------------------------------------

    async def metrics(self, *, timeout_s: float | None = None) -> EngineMetrics:
        """Scrape ``/metrics``; prefix-cache counters and running/waiting gauges, summed, and the
        API server's process start time."""
        r = await self._call("GET", "/metrics", mutating=False, timeout_s=timeout_s)
        try:
            return EngineMetrics.parse(r.text)
        except ValueError as e:
            raise self._unexpected(r, f"unparsable metrics ({e})", mutating=False) from e

    async def complete(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 16,
        temperature: float = 0.0,
        *,
        cache_salt: str | None = None,
        ignore_eos: bool = True,
        extra: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, ...]:
        """``POST /v1/completions`` -> the generated token ids (``return_token_ids``).

        Used for probes: greedy by default, ``ignore_eos`` so the length is fixed. On 0.26/0.32
        a request sent to a *paused* engine waits silently until resume, i.e. until
        ``timeout_s``. Read-only for the error table.
        """
        body: dict[str, Any] = {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
            "ignore_eos": ignore_eos,
        }
        if self.model_id is not None:
            body["model"] = self.model_id
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        body.update(extra or {})
        r = await self._call(
            "POST", "/v1/completions", mutating=False, timeout_s=timeout_s, json=body
        )
        try:
            ids = self._body(r, mutating=False)["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError):
            ids = None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise self._unexpected(r, "no choices[0].token_ids", mutating=False)
        return tuple(ids)
