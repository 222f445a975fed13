"""The replica's answer, passed on to the client (:mod:`router.proxy` says what differs and
tabulates every outcome): a whole JSON body, or an SSE stream passed through event by event.

Both paths check vLLM's ``weight_versions`` spans against the bound label (I7), count usage
tokens, and settle the binding **before** the client gets the answer (a whole body) or its last
chunk (a stream), delivering output only for a binding the settlement confirmed
(:func:`confirm`). A violation taints the replica only then (:func:`report_violation`).

Concurrency: one call per request, on the request's task; nothing here is shared between
requests except the app's resources (store, metrics, view).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pool.errors import StoreError
from pool.types import ReplicaRecord
from pool.web import (
    Conflict,
    dumpb,
    json_response,
    loads,
)
from router.bindings import Outcome, Settled, Settlement, shielded
from router.errors import BindingEnded, RouterError, UpstreamError, UpstreamTimeout
from router.failover import STREAM
from router.keys import (
    CATALOG,
    METRICS,
    SETTINGS,
    STORE,
    VIEW,
)
from router.limits import Deadline
from router.provenance import (
    HEADER_ID,
    RolloutInfo,
    SpanCheck,
    check_response,
    usage_tokens,
)

MAX_SSE_EVENT_BYTES = 64 * 1024 * 1024
EXCERPT = 500

log = logging.getLogger("router")


@dataclass
class Timings:
    """Where one non-streamed request's time went (seconds), sent as ``Server-Timing`` with
    the answer: ``admit`` (choosing + the ADMIT round trip), ``upstream`` (the replica's answer)
    and ``router`` (everything in the handler but ``upstream``, the release included)."""

    start: float
    admit: float = 0.0
    upstream: float = 0.0

    def header(self) -> str:
        total = time.perf_counter() - self.start
        parts = {"admit": self.admit, "upstream": self.upstream, "router": total - self.upstream}
        return ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in parts.items())


TIMINGS = web.RequestKey("timings", Timings)


@dataclass(frozen=True)
class Target:
    """Where, under which binding and until when a request runs."""

    info: RolloutInfo
    replica: ReplicaRecord
    deadline: Deadline


async def confirm(request: web.Request, target: Target, verdict: Settled) -> None:
    """Raise unless ``verdict`` proves the binding was active until the request ended."""
    if verdict is Settled.CONFIRMED:
        return
    info = target.info
    if verdict is Settled.UNCONFIRMED:
        raise BindingEnded(
            f"rollout {info.rollout_id}: the store could not confirm its binding; its output "
            f"is withheld",
            code="store_unavailable",
            headers=info.headers(),
            rollout=info.as_json(),
        )
    try:
        b = await shielded(request.app[STORE].binding(info.rollout_id))
        state, reason = str(b.state), b.reason
    except StoreError:
        state, reason = "unknown", ""
    log.warning(
        "rollout %s: binding ended under the request (%s: %s); output withheld",
        info.rollout_id,
        state,
        reason,
    )
    session = request.headers.get(HEADER_ID) is not None
    raise (Conflict if session else BindingEnded)(
        f"rollout {info.rollout_id}'s binding was ended while it ran ({state}"
        f"{': ' + reason if reason else ''}); its output cannot be attributed to generation "
        f"{info.generation} and is withheld",
        code="binding_ended",
        headers=info.headers(),
        state=state,
        reason=reason,
        rollout=info.as_json(),
    )


def upstream_failure(
    e: BaseException, target: Target, outcome: Outcome, phase: str, expired: bool = False
) -> RouterError:
    headers = target.info.headers()
    rid = target.replica.replica_id
    if expired:  # the request's own deadline, not the replica's silence
        outcome.abort(target.deadline.reason)
        return UpstreamTimeout(
            f"rollout {target.info.rollout_id} ended: {target.deadline.reason}",
            code="deadline_exceeded",
            headers=headers,
            replica=rid,
            rollout=target.info.as_json(),
        )
    if isinstance(e, TimeoutError):
        outcome.abort("upstream timeout")
        return UpstreamTimeout(
            f"replica {rid} sent nothing for too long ({phase})",
            headers=headers,
            replica=rid,
            rollout=target.info.as_json(),
        )
    outcome.abort(f"upstream connection failed: {type(e).__name__}")
    log.warning(
        "rollout %s: replica %s (%s), %s: %r",
        target.info.rollout_id,
        rid,
        target.replica.url,
        phase,
        e,
    )
    return UpstreamError(
        f"replica {rid} could not be reached or the connection was lost ({phase})",
        code="upstream_unavailable",
        headers=headers,
        replica=rid,
        rollout=target.info.as_json(),
    )


async def report_violation(app: web.Application, target: Target, reason: str) -> None:
    """Taint the replica and count the violation. Only for a binding the settlement confirmed
    (still active until the answer): spans that contradict a binding which had already ended
    prove nothing against the replica (the updater may have aborted the binding at a drain
    deadline and changed the weights, as it may); such output is withheld as ``binding_ended``."""
    rid = target.replica.replica_id
    app[METRICS].violations.labels(rid).inc()
    try:
        await app[STORE].taint(rid, f"provenance violation: {reason}", source="router")
    except StoreError as e:
        log.error("could not taint %s after a violation: %s", rid, e.message)
    app[VIEW].invalidate()


class BodyTooLarge(Exception):
    """An upstream body exceeded ``max_upstream_body_bytes``."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole upstream body, or :class:`BodyTooLarge` as soon as it exceeds ``limit``."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge
    buf = bytearray()
    async for piece in resp.content.iter_any():
        buf += piece
        if len(buf) > limit:
            raise BodyTooLarge
    return bytes(buf)


async def whole_answer(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    target: Target,
    model: str | None,
    outcome: Outcome,
    settle: Settlement,
    sent: float,
    expect_model: str | None = None,
) -> web.Response:
    info = target.info
    rid = target.replica.replica_id
    limit = request.app[SETTINGS].max_upstream_body_bytes
    deadline = asyncio.timeout_at(target.deadline.at)
    try:
        async with deadline:
            raw = await read_capped(resp, limit)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise upstream_failure(e, target, outcome, "response", deadline.expired()) from e
    except BodyTooLarge as e:
        outcome.abort(f"upstream body larger than {limit} bytes")
        raise UpstreamError(
            f"replica {rid} answered a body larger than the router's limit of {limit} bytes",
            headers=info.headers(),
            replica=rid,
            rollout=info.as_json(),
        ) from e
    timings = request.get(TIMINGS)
    if timings is not None:
        timings.upstream = time.perf_counter() - sent
    status = resp.status
    if status >= 500 or status < 200:
        outcome.abort(f"upstream {status // 100}xx: HTTP {status}")
        log.warning(
            "rollout %s: replica %s answered HTTP %d: %s",
            info.rollout_id,
            rid,
            status,
            raw[:EXCERPT].decode(errors="replace"),
        )
        raise UpstreamError(
            f"replica {rid} answered HTTP {status}",
            headers=info.headers(),
            replica=rid,
            upstream_status=status,
            rollout=info.as_json(),
        )
    if status >= 400:
        outcome.abort(f"upstream 4xx: HTTP {status}")
        if status == 404:
            request.app[CATALOG].forget(target.replica)
        try:
            err = loads(raw)
        except ValueError:
            err = None
        if isinstance(err, dict):
            err["rollout"] = info.as_json()
            return json_response(err, status=status, headers=info.headers())
        return web.Response(
            body=raw, status=status, headers=info.headers(), content_type=resp.content_type
        )
    try:
        data = loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        outcome.abort("upstream returned a body that is not a JSON object")
        log.warning(
            "rollout %s: replica %s returned a body that is not a JSON object: %s",
            info.rollout_id,
            rid,
            raw[:EXCERPT].decode(errors="replace"),
        )
        raise UpstreamError(
            f"replica {rid} returned a body that is not a JSON object",
            headers=info.headers(),
            replica=rid,
            rollout=info.as_json(),
        )
    violation = check_response(data, info.label, expect_model)
    if violation is not None:
        outcome.violate(violation)
        verdict = await settle(outcome)  # first: was the binding still active?
        await confirm(request, target, verdict)  # if not: binding_ended / store_unavailable
        await report_violation(request.app, target, violation)
        raise UpstreamError(
            f"rollout {info.rollout_id} violated its binding: {violation}",
            code="provenance_violation",
            headers=info.headers(),
            replica=rid,
            reason=violation,
            rollout=info.as_json(),
        )
    outcome.finish(usage_tokens(data), upstream_aborted(finish_reasons(data), usage_tokens(data)))
    data["rollout"] = info.as_json()
    if expect_model is not None:  # a LoRA pool: the adapter that generated it
        data["rollout"]["adapter"] = expect_model
    if model is not None and "model" in data:
        data["model"] = model
    return json_response(data, status=status, headers=info.headers())


# ------------------------------------------------------------------------------ streaming


class ClientGone(Exception):
    """Writing to the client failed: it disconnected, or stopped reading (the message says)."""


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The ``data`` payload of each server-sent event, as bytes, in order."""
    buf = bytearray()
    async for piece in content.iter_any():
        buf += piece
        if b"\r" in piece:
            buf[:] = buf.replace(b"\r\n", b"\n")
        while (end := buf.find(b"\n\n")) >= 0:
            event = bytes(buf[:end])
            del buf[: end + 2]
            lines = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                yield b"\n".join(lines)
        if len(buf) > MAX_SSE_EVENT_BYTES:
            raise aiohttp.ClientPayloadError("server-sent event too large")
    if buf.strip():
        lines = [ln[5:].lstrip(b" ") for ln in bytes(buf).split(b"\n") if ln.startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)


def finish_reasons(body: dict[str, Any]) -> list[str]:
    """The ``finish_reason`` of every choice in ``body`` (a response or a chunk) that has one."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    return [
        str(c["finish_reason"])
        for c in choices
        if isinstance(c, dict) and c.get("finish_reason") is not None
    ]


def upstream_aborted(reasons: list[str], tokens: tuple[int, int] | None) -> str | None:
    """Why a complete answer counts as aborted by vLLM, or None if it finished.

    vLLM ends an aborted request (``/abort_requests``, a pause in ``abort`` mode) with
    ``finish_reason: "abort"`` (one it could not run, from 0.33: ``"error"``), or, for a
    completion or chat request aborted before its first token, streams no finishing choice
    chunk at all: only the usage chunk and ``[DONE]`` (pinned against real vLLM by
    ``test_standin_conformance``)."""
    completion = None if tokens is None else tokens[1]
    for reason in ("abort", "error"):
        if reason in reasons:
            after = "" if completion is None else f" after {completion} tokens"
            return f"upstream aborted the request (finish_reason {reason!r}){after}"
    if not reasons:
        if not completion:
            return "upstream aborted the request before its first token"
        return "upstream ended the stream without a finish_reason"
    return None


async def stream_answer(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    target: Target,
    model: str | None,
    wants_usage: bool,
    outcome: Outcome,
    settle: Settlement,
    expect_model: str | None = None,
) -> web.StreamResponse:
    info = target.info
    out = web.StreamResponse(
        status=200,
        headers={
            **info.headers(),
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    await out.prepare(request)
    write_timeout = request.app[SETTINGS].client_write_timeout_s
    request[STREAM] = out  # a cut ends the stream with an error event (router.failover)

    async def send(payload: bytes | None) -> None:
        """Write one event; a client that does not take it within ``write_timeout`` (it
        stopped reading: the socket buffers are full) is cut off like one that left."""
        try:
            async with asyncio.timeout(write_timeout):
                if payload is None:
                    await out.write_eof()
                else:
                    await out.write(b"data: " + payload + b"\n\n")
        except ConnectionResetError as e:
            raise ClientGone("client disconnected") from e
        except TimeoutError as e:
            if request.transport is not None:
                request.transport.abort()
            raise ClientGone(
                f"client stopped reading: an event waited {write_timeout:g} s to be sent"
            ) from e

    check = SpanCheck(info.label, expect_model)
    tokens: tuple[int, int] | None = None
    reasons: list[str] = []
    held: dict[str, Any] | None = None
    error: str | None = None
    failure: str | None = None
    done = False
    deadline = asyncio.timeout_at(target.deadline.at)
    try:
        try:
            async with deadline:
                async for payload in sse_events(resp.content):
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = loads(payload)
                    except ValueError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        await send(payload)
                        continue
                    if "error" in chunk and not chunk.get("choices"):
                        err = chunk["error"]
                        error = str(err.get("message", err) if isinstance(err, dict) else err)
                    check.observe(chunk)
                    tokens = usage_tokens(chunk) or tokens
                    if model is not None and "model" in chunk:
                        chunk["model"] = model
                    usage_only = chunk.get("choices") == [] and "usage" in chunk
                    if usage_only and not wants_usage:
                        continue
                    if held is not None:
                        await send(dumpb(held))
                        held = None
                    ends = finish_reasons(chunk)
                    reasons += ends
                    if usage_only or ends:
                        held = chunk
                    else:
                        await send(dumpb(chunk))
        except (aiohttp.ClientError, TimeoutError) as e:
            if deadline.expired():
                failure = target.deadline.reason
            elif isinstance(e, TimeoutError):
                failure = "upstream timeout"
            else:
                failure = f"upstream connection lost: {type(e).__name__}"

        violation = check.violation()
        if violation is not None:
            outcome.violate(violation)
        elif failure is not None:
            outcome.abort(failure)
        elif error is not None:
            outcome.abort(f"upstream stream error: {error[:200]}")
        elif not done:
            outcome.abort("upstream stream ended without [DONE]")
        else:
            outcome.finish(tokens, upstream_aborted(reasons, tokens))
        verdict = await settle(outcome)

        rollout = info.as_json()
        if expect_model is not None:  # a LoRA pool: the adapter that generated it
            rollout["adapter"] = expect_model
        problem: tuple[str, str] | None = None
        if violation is not None and verdict is Settled.CONFIRMED:
            await report_violation(request.app, target, violation)
            rollout["violation"] = violation
            problem = ("provenance_violation", violation)
        elif failure is not None or (not done and error is None):
            code = "deadline_exceeded" if deadline.expired() else "upstream_error"
            problem = (code, failure or "upstream stream ended without [DONE]")
        elif outcome.answered and verdict is not Settled.CONFIRMED:
            rollout["unconfirmed"] = True
            why = "could not be confirmed" if verdict is Settled.UNCONFIRMED else "was ended"
            problem = (
                "binding_ended" if verdict is Settled.ENDED_ELSEWHERE else "store_unavailable",
                f"the rollout's binding {why} while it ran; its output cannot be attributed "
                f"to generation {info.generation}",
            )
        if held is not None:
            held["rollout"] = rollout
            await send(dumpb(held))
        if problem is not None:
            err = {"code": problem[0], "message": problem[1], "rollout": rollout}
            await send(dumpb({"error": err}))
        else:
            await send(b"[DONE]")
        await send(None)
    except ClientGone as e:
        resp.close()  # the client is gone: stop the generation upstream
        if not settle.done:
            outcome.abort(str(e))
    return out
