"""Forwarding ``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate``.

One request is one rollout (admitted here, released when it ends) unless it carries
``X-Rollout-Id`` of an open session (:mod:`router.sessions`). The forwarded body differs from
the client's in exactly these ways:

* ``model`` becomes the replica's own model id (vLLM names it by its path); the client may send
  the router's ``served_model_name``, a replica's id, or nothing; anything else is 404
  ``model_not_found``. Responses carry the name the client asked for. In a LoRA pool
  (``generations: lora``) it becomes the bound generation's adapter instead
  (:func:`pool.adapters.adapter_name`; generation 0: the model id), and the answer must name
  that adapter (a violation otherwise, as a contradicting span); the ``rollout`` object then
  carries it as ``adapter``.
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
flight per client; concurrent requests of a session, :mod:`router.session_runs`) is answered 429
with ``Retry-After``, and the deadline runs from its arrival. A request asking for more than one
sequence (``n``, ``best_of``, a prompt array: :func:`router.limits.sequences`) is charged one
slot per sequence under a grant, and refused (400) where it cannot be charged
(:func:`router.limits.check_sequences`).

**Client disconnects.** The router is served with aiohttp's ``handler_cancellation=True``
(:func:`pool.web.start_server`, :mod:`router.__main__`; aiohttp's test server does the same):
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
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from pool.adapters import adapter_name
from pool.store.grants import FinalRecord
from pool.types import BindingState, Generation, ReplicaRecord
from pool.web import (
    CLIENT,
    BadRequest,
    RouteNotFound,
    dumpb,
    dumps,
    read_json_object,
)
from router import limits, sessions
from router.admission import affinity_key
from router.answers import (
    TIMINGS,
    Target,
    Timings,
    confirm,
    stream_answer,
    upstream_failure,
    whole_answer,
)
from router.bindings import DEFAULT_REASON, Held, Outcome, Settled, Settlement
from router.constraints import Constraints
from router.errors import UpstreamError
from router.failover import cuttable
from router.keys import (
    ADMITTER,
    BINDINGS,
    CATALOG,
    GRANTS,
    HTTP,
    IN_FLIGHT,
    RECORDER,
    RUNS,
    SETTINGS,
    VIEW,
)
from router.limits import Deadline
from router.provenance import (
    HEADER_ID,
    RolloutInfo,
    new_rollout_id,
)
from router.upstream import ReplicaInfo

INFERENCE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
GENERATE = "/inference/v1/generate"
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\x00")
JSON_HEADERS = {"Content-Type": "application/json"}

log = logging.getLogger("router")


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
    seqs = limits.sequences(request.path, body)
    accept = await _model_filter(request, model)

    header = request.headers.get(HEADER_ID)
    session_id = None if header is None else header.strip()
    replicas = (await app[VIEW].get()).replicas
    limits.check_sequences(
        seqs, session=session_id is not None, grants=settings.grants, replicas=replicas
    )
    with app[IN_FLIGHT].hold(request.get(CLIENT), limits.pool_capacity(replicas)):
        if session_id is None:
            return await _single(request, body, constraints, model, accept, deadline, seqs.count)
        async with app[RUNS].hold(session_id) as mark:
            info, replica, settle, ends_ms = await sessions.resolve(
                request, session_id, constraints, accept
            )
            target = Target(info, replica, deadline.capped(ends_ms))
            lease_s = sessions.session_lease_s(settings)
            settle = app[RUNS].settling(mark, settle)
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
    slots: int,
) -> web.StreamResponse:
    """A one-request rollout asking for ``slots`` sequences (1 unless under grants): admit,
    forward, release."""
    app = request.app
    settings = app[SETTINGS]
    rollout_id = new_rollout_id()
    timings = request[TIMINGS] = Timings(time.perf_counter())
    if settings.grants:
        return await _under_grant(
            request, rollout_id, body, constraints, model, accept, deadline, slots
        )
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
    settle = bindings.settlement(
        rollout_id, replica.replica_id, then=lambda: view.finished(replica.replica_id)
    )
    target = Target(RolloutInfo.of_admission(adm), replica, deadline)
    lease_s = settings.request_lease_s
    with bindings.renewing(rollout_id, lease_s, target.info, epoch=admitted.epoch) as held:
        run = run_settled(request, target, body, model, settle)
        return await cuttable(request, held, run)


async def _under_grant(
    request: web.Request,
    rollout_id: str,
    body: dict[str, Any],
    constraints: Constraints,
    model: str | None,
    accept: Callable[[ReplicaRecord], bool] | None,
    deadline: Deadline,
    slots: int,
) -> web.StreamResponse:
    """A one-request rollout under one of this router's grants (:mod:`router.grants`), charged
    ``slots`` slots (its sequences): admit and settle locally, forward as any request; the
    slots go back and the record is queued (:mod:`router.records`) once the answer is out."""
    app = request.app
    admitted = await app[ADMITTER].admit_granted(
        rollout_id, constraints, affinity_key(body), accept=accept, slots=slots
    )
    lg, replica, adm = admitted.grant, admitted.replica, admitted.admission
    assert lg is not None
    timings = request[TIMINGS]
    timings.admit = time.perf_counter() - timings.start
    view, book = app[VIEW], app[GRANTS]
    view.started(replica.replica_id, slots)
    info = RolloutInfo.of_admission(adm)
    held = Held(0.0, time.monotonic(), info, epoch=admitted.epoch)
    task = asyncio.current_task()
    if task is not None:
        held.tasks.add(task)
    ended = Outcome()
    verdict: Settled | None = None

    async def settle(o: Outcome) -> Settled:
        nonlocal ended, verdict
        ended, verdict = o, book.settle(lg, rollout_id)
        return verdict

    book.run(lg, rollout_id, held)
    try:
        run = run_settled(request, Target(info, replica, deadline), body, model, Settlement(settle))
        return await cuttable(request, held, run)
    finally:
        book.put(lg, rollout_id, slots)
        view.finished(replica.replica_id, slots)
        o, state, reason = ended, ended.state, ended.reason
        if held.cut is not None:  # as Bindings.end: a cut request ends with the cut's reason
            state, reason = BindingState.ABORTED, held.cut
        elif verdict is not Settled.CONFIRMED and state is not BindingState.ABORTED:
            state = BindingState.ABORTED
            reason = lg.aborted or "its grant could not be confirmed (output withheld)"
        app[RECORDER].add(
            FinalRecord(
                rollout_id,
                replica.replica_id,
                adm.generation,
                adm.label,
                adm.identity_digest,
                state,
                reason,
                o.prompt_tokens,
                o.completion_tokens,
                adm.created_ms,
                limits.terms(app[SETTINGS], request.get(CLIENT), session=False).owner,
            ),
            info,
        )


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
    body: dict[str, Any], route: str, label: str, model: str, info: ReplicaInfo, stream: bool
) -> dict[str, Any]:
    """The body sent to the replica (see the module docstring for every difference)."""
    out = dict(body)
    out["model"] = model
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
    health = app[VIEW].health
    try:
        info = await app[CATALOG].info(target.replica)
    except UpstreamError as e:  # shared by concurrent waiters: raise a fresh one
        health.failed(target.replica.url)
        outcome.abort(f"upstream unavailable: {e.message}")
        raise UpstreamError(
            e.message,
            code=e.code,
            headers=target.info.headers(),
            replica=target.replica.replica_id,
            rollout=target.info.as_json(),
        ) from e
    adapter = None
    if app[SETTINGS].generations == "lora":
        adapter = adapter_name(Generation(number=target.info.generation, label=target.info.label))
    upstream_model = adapter or info.model_id
    payload = dumpb(upstream_body(body, route, target.info.label, upstream_model, info, stream))
    url = upstream_url(target.replica.url, route)
    sent = time.perf_counter()
    deadline = asyncio.timeout_at(target.deadline.at)
    try:
        async with deadline:
            resp = await app[HTTP].post(url, data=payload, headers=JSON_HEADERS)
    except (aiohttp.ClientError, TimeoutError) as e:
        if isinstance(e, aiohttp.ClientConnectionError) and not isinstance(e, TimeoutError):
            health.failed(target.replica.url)  # refused, reset, unreachable: not slow
        raise upstream_failure(e, target, outcome, "request", deadline.expired()) from e
    health.answered(target.replica.url)
    complete = False
    try:
        if stream and resp.status == 200 and resp.content_type == "text/event-stream":
            wants_usage = isinstance(body.get("stream_options"), dict) and bool(
                body["stream_options"].get("include_usage")
            )
            out = await stream_answer(
                request, resp, target, model, wants_usage, outcome, settle, adapter
            )
        else:
            out = await whole_answer(request, resp, target, model, outcome, settle, sent, adapter)
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
