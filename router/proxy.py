"""Forwarding ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``.

One request is one rollout (admitted here, released when it ends) unless it carries
``X-Rollout-Id`` of an open session (:mod:`router.sessions`). The forwarded body differs from
the client's in exactly these ways:

* ``model`` becomes the replica's own model id (vLLM names it by its path); the client may send
  the router's ``served_model_name``, a replica's id, or nothing; anything else is 404
  ``model_not_found``. Responses carry the name the client asked for.
* ``cache_salt`` becomes the bound generation's label (``label:client-salt`` if the client sent
  one, hashed where vLLM would refuse it: :func:`cache_salt`), so prefix-cache entries never
  cross a weight change (reference/vllm-api.md §4).
* the optional ``rollout`` field (constraints) is removed; streamed requests ask for a final
  ``usage`` chunk (dropped again if the client did not ask for it); replicas on vLLM 0.33+ are
  asked for ``weight_versions`` on completions too.

Responses: every JSON body gets a ``rollout`` object and every response ``X-Rollout-*`` headers
(:mod:`router.provenance`); a non-streamed one-request rollout also gets a ``Server-Timing``
header (``admit``, ``upstream`` and ``router`` = everything but upstream, in ms).
SSE chunks are passed through one by one as they arrive; the chunk that carries a
``finish_reason`` (or the final usage chunk) is held until the next event so the ``rollout``
object can be put into the last data chunk before ``[DONE]``.

Ending the binding, exactly once per request, **before** the answer (or a stream's last chunk)
is delivered. A release that finds the binding still active proves the replica's weights did not
change while the request ran (I2), so only such output is delivered: if the binding was ended
under the request (the updater aborted it at a drain deadline, the reaper, a session close) the
answer is replaced by 503 ``binding_ended`` (409 for a session; an SSE error event instead of
``[DONE]`` for a stream), and if Redis cannot be reached to confirm it, by 503
``store_unavailable``. This also closes the window in which a request admitted just before a
drain reaches an already paused vLLM 0.26/0.32 (which queues it silently) and runs on the next
weights, on every endpoint, spans or not. The provenance record is final when the client has
its answer.

==========================================  ===========================================
what happened                               binding / answer
==========================================  ===========================================
2xx, spans (if any) prove the label         ``finished`` with usage token counts
spans contradict the label                  ``violated``; replica tainted; 502
vLLM aborted it (``finish_reason`` abort,   ``aborted`` "upstream aborted the request ...";
or a stream with no finishing chunk)        the answer passed through
upstream 4xx                                ``aborted`` "upstream 4xx: HTTP n"; status and
                                            body passed through
upstream 5xx / bad body                     ``aborted``; 502
connection failed or lost                   ``aborted``; 502 (or an SSE error event)
no byte for ``upstream_timeout_s``          ``aborted``; 504 (or an SSE error event)
past ``request_deadline_s`` (for a          ``aborted`` with the reason; 504
session's request: or its maximum age)      ``deadline_exceeded`` (or an SSE error event)
binding ended under the request            (left as ended); 503 ``binding_ended``
binding ended or lost while it runs         cut at once (router.failover): 503
                                            ``binding_lost`` (or an SSE error event)
client disconnected                         ``aborted`` "client disconnected"; the upstream
                                            connection is closed, so vLLM aborts the request
a stream the client does not read for       ``aborted`` "client stopped reading: ..."; both
``client_write_timeout_s``                  connections are closed
any other exception / cancellation          ``aborted`` with the reason
==========================================  ===========================================

Before any of that, a request over one of its client's limits (:mod:`router.limits`: requests in
flight per client, concurrent requests of a session) is answered 429 with ``Retry-After``, and
the deadline runs from its arrival.

**Client disconnects.** The router is served with aiohttp's ``handler_cancellation=True``
(:func:`router.app.start_server`, :mod:`router.__main__`; aiohttp's test server does the same):
a lost client connection cancels the handler task, the ``CancelledError`` closes the upstream
response (vLLM sees the disconnect and aborts the generation) and the shielded release records
``client disconnected``. Without handler cancellation the router still notices a streaming client
leaving (the next SSE write fails: same outcome); a non-streamed request then runs to its end.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from pool.errors import StoreError
from pool.types import ReplicaRecord
from pool.web import (
    CLIENT,
    BadRequest,
    Conflict,
    RouteNotFound,
    dumpb,
    dumps,
    json_response,
    loads,
    read_json_object,
)
from router import limits, sessions
from router.admission import Constraints, affinity_key
from router.bindings import DEFAULT_REASON, Outcome, Settled, Settlement, shielded
from router.errors import BindingEnded, RouterError, UpstreamError, UpstreamTimeout
from router.failover import STREAM, cuttable
from router.keys import (
    ADMITTER,
    BINDINGS,
    CATALOG,
    HTTP,
    IN_FLIGHT,
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
    new_rollout_id,
    usage_tokens,
)
from router.upstream import ReplicaInfo

INFERENCE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
GENERATE = "/inference/v1/generate"
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_SSE_EVENT_BYTES = 64 * 1024 * 1024
EXCERPT = 500
JSON_HEADERS = {"Content-Type": "application/json"}

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


# ------------------------------------------------------------------------------ entry point


async def handle_inference(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS]
    deadline = Deadline.of_request(settings)
    body = await read_json_object(request, settings.max_body_bytes)
    constraints = Constraints.from_headers(request.headers)
    if "rollout" in body:
        constraints = constraints.merge(Constraints.parse(body.pop("rollout"), "'rollout' field"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RouteNotFound("'model' must be a string", code="model_not_found")
    check_fields(body)
    accept = await _model_filter(request, model)

    header = request.headers.get(HEADER_ID)
    session_id = None if header is None else header.strip()
    with app[IN_FLIGHT].hold(request.get(CLIENT), session_id):
        if session_id is None:
            return await _single(request, body, constraints, model, accept, deadline)
        info, replica, settle, ends_ms = await sessions.resolve(
            request, session_id, constraints, accept
        )
        target = Target(info, replica, deadline.capped(ends_ms))
        lease_s = sessions.session_lease_s(settings)
        with app[BINDINGS].renewing(info.rollout_id, lease_s, info, session=True) as held:
            run = run_settled(request, target, body, model, settle)
            return await cuttable(request, held, run)


async def _single(
    request: web.Request,
    body: dict[str, Any],
    constraints: Constraints,
    model: str | None,
    accept: Callable[[ReplicaRecord], bool] | None,
    deadline: Deadline,
) -> web.StreamResponse:
    """A one-request rollout: admit, forward, release."""
    app = request.app
    settings = app[SETTINGS]
    rollout_id = new_rollout_id()
    timings = request[TIMINGS] = Timings(time.perf_counter())
    admitted = await app[ADMITTER].admit(
        rollout_id,
        constraints,
        affinity_key(body),
        session=False,
        lease_s=settings.request_lease_s,
        accept=accept,
        terms=limits.terms(settings, request.get(CLIENT), session=False),
    )
    adm, replica = admitted.admission, admitted.replica
    timings.admit = time.perf_counter() - timings.start
    view, bindings = app[VIEW], app[BINDINGS]
    view.started(replica.replica_id)

    async def release(o: Outcome) -> Settled:
        try:
            return await bindings.release(
                rollout_id,
                replica.replica_id,
                o.state,
                o.reason,
                o.prompt_tokens,
                o.completion_tokens,
            )
        finally:
            view.finished(replica.replica_id)

    target = Target(RolloutInfo.of_admission(adm), replica, deadline)
    lease_s = settings.request_lease_s
    with bindings.renewing(rollout_id, lease_s, target.info, epoch=admitted.epoch) as held:
        run = run_settled(request, target, body, model, Settlement(release))
        return await cuttable(request, held, run)


async def run_settled(
    request: web.Request,
    target: Target,
    body: dict[str, Any],
    model: str | None,
    settle: Settlement,
) -> web.StreamResponse:
    """:func:`forward` with the settlement done exactly once on every exit path, and a whole
    answer delivered only if the settlement confirmed the binding."""
    outcome = Outcome()
    try:
        response = await forward(request, target, body, model, outcome, settle)
        if not response.prepared:  # a whole answer: settle, then deliver only if confirmed
            verdict = await settle(outcome)
            if outcome.answered:
                await confirm(request, target, verdict)
            timings = request.get(TIMINGS)
            if timings is not None:
                response.headers["Server-Timing"] = timings.header()
        return response
    except asyncio.CancelledError:
        if not settle.done:
            outcome.abort("client disconnected")
        raise
    except BaseException as e:
        if outcome.reason == DEFAULT_REASON:
            outcome.abort(f"router error: {type(e).__name__}")
        raise
    finally:
        await settle(outcome)


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


async def _model_filter(
    request: web.Request, model: str | None
) -> Callable[[ReplicaRecord], bool] | None:
    """None if any replica may serve ``model``; else a filter; 404 if nobody serves it."""
    settings = request.app[SETTINGS]
    if model is None or model == settings.served_model_name:
        return None
    catalog = request.app[CATALOG]
    snap = await request.app[VIEW].get()
    infos = await asyncio.gather(
        *(catalog.info(r) for r in snap.replicas if r.url), return_exceptions=True
    )
    served = {i.model_id for i in infos if isinstance(i, ReplicaInfo)}
    if model not in served:
        raise RouteNotFound(
            f"model {model!r} is not served here; use {settings.served_model_name!r}",
            code="model_not_found",
            model=model,
        )

    def accept(r: ReplicaRecord) -> bool:
        info = catalog.cached(r)
        return info is not None and info.model_id == model

    return accept


# ------------------------------------------------------------------------------ forwarding


def check_fields(body: dict[str, Any]) -> None:
    """400 for fields the router itself acts on but cannot read: ``stream`` must be a boolean
    (vLLM would take ``"true"`` for true and stream, while the router waited for one JSON body),
    ``stream_options`` an object. The replica validates everything else."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(
            f"'stream' must be true or false, not {dumps(stream)[:40]}", code="invalid_body"
        )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", code="invalid_body")


def cache_salt(label: str, client_salt: Any) -> str:
    """The salt forwarded to the replica: the label, or ``label:client-salt``.

    vLLM 0.32 refuses (400) a salt longer than :data:`MAX_CACHE_SALT` (128) characters or one
    containing ``@``, ``/``, ``\\`` or NUL; a label (at most 128 characters of
    ``[A-Za-z0-9-_.:+]``) always passes. A combined salt that would not pass is replaced by a
    digest that still keys on both: ``label:<sha256 of the client salt>`` where that fits,
    else the sha256 of ``label:client-salt`` (64 hex digits). Equal client salts keep sharing
    their prefix cache within a generation; nothing is shared across generations."""
    if not isinstance(client_salt, str) or not client_salt:
        return label
    salt = f"{label}:{client_salt}"
    if len(salt) <= MAX_CACHE_SALT and not _SALT_FORBIDDEN.intersection(salt):
        return salt
    digest = hashlib.sha256(client_salt.encode()).hexdigest()
    if len(label) + 1 + len(digest) <= MAX_CACHE_SALT:
        return f"{label}:{digest}"
    return hashlib.sha256(salt.encode()).hexdigest()


def upstream_body(
    body: dict[str, Any], route: str, label: str, info: ReplicaInfo, stream: bool
) -> dict[str, Any]:
    """The body sent to the replica (see the module docstring for every difference)."""
    out = dict(body)
    out["model"] = info.model_id
    out["cache_salt"] = cache_salt(label, body.get("cache_salt"))
    if stream:
        options = out.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        out["stream_options"] = options
    if route != GENERATE and info.capabilities.spans_completions:
        out["return_weight_versions"] = True
    return out


async def forward(
    request: web.Request,
    target: Target,
    body: dict[str, Any],
    model: str | None,
    outcome: Outcome,
    settle: Settlement,
) -> web.StreamResponse:
    """Send the request to ``target`` and build the client's response. Fills in ``outcome``;
    a stream is written (and settled, before its last chunk) here, a whole answer is returned
    unsent and unsettled."""
    app = request.app
    route = request.path
    stream = body.get("stream") is True
    try:
        info = await app[CATALOG].info(target.replica)
    except UpstreamError as e:  # shared by concurrent waiters: raise a fresh one
        outcome.abort(f"upstream unavailable: {e.message}")
        raise UpstreamError(
            e.message,
            code=e.code,
            headers=target.info.headers(),
            replica=target.replica.replica_id,
            rollout=target.info.as_json(),
        ) from e
    payload = dumpb(upstream_body(body, route, target.info.label, info, stream))
    url = upstream_url(target.replica.url, route)
    sent = time.perf_counter()
    deadline = asyncio.timeout_at(target.deadline.at)
    try:
        async with deadline:
            resp = await app[HTTP].post(url, data=payload, headers=JSON_HEADERS)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _upstream_failure(e, target, outcome, "request", deadline.expired()) from e
    complete = False
    try:
        if stream and resp.status == 200 and resp.content_type == "text/event-stream":
            wants_usage = isinstance(body.get("stream_options"), dict) and bool(
                body["stream_options"].get("include_usage")
            )
            out = await _stream(request, resp, target, model, wants_usage, outcome, settle)
        else:
            out = await _whole(request, resp, target, model, outcome, settle, sent)
        complete = True
        return out
    finally:
        if complete:
            resp.release()  # back to the pool if fully read, else the connection is closed
        else:
            resp.close()  # drops the connection: vLLM sees the disconnect and aborts


@functools.lru_cache(maxsize=1024)
def upstream_url(base: str, route: str) -> URL:
    """The replica's URL for ``route``, parsed once (not on every request)."""
    return URL(base.rstrip("/") + route)


def _upstream_failure(
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


async def _whole(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    target: Target,
    model: str | None,
    outcome: Outcome,
    settle: Settlement,
    sent: float,
) -> web.Response:
    info = target.info
    rid = target.replica.replica_id
    limit = request.app[SETTINGS].max_upstream_body_bytes
    deadline = asyncio.timeout_at(target.deadline.at)
    try:
        async with deadline:
            raw = await read_capped(resp, limit)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _upstream_failure(e, target, outcome, "response", deadline.expired()) from e
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
    violation = check_response(data, info.label)
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
    if model is not None and "model" in data:
        data["model"] = model
    return json_response(data, status=status, headers=info.headers())


# ------------------------------------------------------------------------------ streaming


class _ClientGone(Exception):
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


async def _stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    target: Target,
    model: str | None,
    wants_usage: bool,
    outcome: Outcome,
    settle: Settlement,
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
            raise _ClientGone("client disconnected") from e
        except TimeoutError as e:
            if request.transport is not None:
                request.transport.abort()
            raise _ClientGone(
                f"client stopped reading: an event waited {write_timeout:g} s to be sent"
            ) from e

    check = SpanCheck(info.label)
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
    except _ClientGone as e:
        resp.close()  # the client is gone: stop the generation upstream
        if not settle.done:
            outcome.abort(str(e))
    return out
