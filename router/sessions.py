"""Rollout sessions: the requests of one multi-turn rollout, pinned to one replica and generation.

* ``POST /v1/rollouts`` (optional body ``{min_generation, generation}``, or the
  ``X-Rollout-*`` constraint headers) admits a *session* binding with lease
  ``session_lease_s`` → 201 ``{rollout_id, generation, label, identity_digest, replica,
  lease_expires_ms, deadline_ms}``, on the terms of :func:`router.limits.terms`: owned by the
  client that opened it (when client keys are configured), ended at ``session_max_age_s``
  (``deadline_ms``) and after ``session_idle_s`` without a request, counted against the
  client's session quota (``client_max_sessions``, by default half the pool's capacity: 429
  ``client_sessions``).
* Requests with ``X-Rollout-Id: <id>`` go to the session's replica with its generation's cache
  salt (:func:`resolve`), at most ``session_max_in_flight`` at a time across every worker and
  router (:mod:`router.session_runs`: 429 ``session_busy``), each asking for one sequence.
  Each one renews the lease and counts itself (``requests + 1``) before it is forwarded, renews
  the lease while it runs, and adds its token counts when it finishes; that last touch also
  proves the session was still active, else the answer is withheld (409 ``binding_ended``, see
  :mod:`router.proxy`). A failed request (upstream error, client disconnect) leaves the session
  open; a provenance violation ends it as ``violated``.
* ``POST /v1/rollouts/{id}/heartbeat`` renews the lease (never past the maximum age or the
  idle limit); ``POST /v1/rollouts/{id}/close`` releases the session as ``finished``. A session
  whose lease runs out is aborted by the reaper, with the reason ("lease expired", or the limit
  it reached); one found past a limit on use is aborted at once, with that reason.
* ``GET /v1/rollouts/{id}`` returns the provenance record of any rollout (session or not).

Every route here, and a request with ``X-Rollout-Id``, is for the rollout's owner (or the admin
token) only: another client gets 404 ``rollout_not_found``, as for an unknown id.

Errors: unknown id → 404 ``rollout_not_found``; a one-request rollout's id → 409
``not_a_session``; an ended session → 409 ``rollout_not_active``; constraints the session's
generation does not meet → 409 ``generation_unsatisfiable``; a session whose replica was tainted
(or otherwise left service) is aborted and answered 409 ``session_replica_unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from pool.adapters import adapter_name
from pool.errors import LimitReached, NotFound, StoreError
from pool.types import Binding, BindingState, Generation, ReplicaRecord, ReplicaState
from pool.web import CLIENT, Conflict, RouteNotFound, json_response, read_json_object
from router import limits
from router.bindings import Settled, Settlement, shielded
from router.constraints import Constraints
from router.keys import ADMITTER, BINDINGS, RECORDER, SETTINGS, STORE, VIEW
from router.provenance import RolloutInfo, new_rollout_id
from router.settings import RouterSettings

log = logging.getLogger("router")

SERVING = frozenset({ReplicaState.READY, ReplicaState.DRAINING})


def session_lease_s(settings: RouterSettings) -> float:
    """A session's lease as its binding has it: never longer than its idle limit or max age."""
    return min(settings.session_lease_s, settings.session_idle_s, settings.session_max_age_s)


def _unknown(rollout_id: str) -> RouteNotFound:
    return RouteNotFound(
        f"unknown rollout {rollout_id}", code="rollout_not_found", rollout_id=rollout_id
    )


async def _binding(request: web.Request, rollout_id: str) -> Binding:
    """The rollout's binding, if the caller may use it: its owner or the admin. Another client
    is told the rollout does not exist."""
    try:
        b = await shielded(request.app[STORE].binding(rollout_id))
    except NotFound as e:
        raise _unknown(rollout_id) from e
    if b.client and request.get(CLIENT) not in (b.client, limits.ADMIN):
        raise _unknown(rollout_id)
    return b


async def _active_session(request: web.Request, rollout_id: str) -> Binding:
    b = await _binding(request, rollout_id)
    if not b.session:
        raise Conflict(
            f"rollout {rollout_id} is a single-request rollout, not a session",
            code="not_a_session",
            rollout_id=rollout_id,
        )
    if b.state is not BindingState.ACTIVE:
        raise Conflict(
            f"session {rollout_id} has ended ({b.state}{': ' + b.reason if b.reason else ''})",
            code="rollout_not_active",
            rollout_id=rollout_id,
            state=str(b.state),
            reason=b.reason,
        )
    return b


def _not_active(rollout_id: str, state: object, reason: str = "") -> Conflict:
    return Conflict(
        f"session {rollout_id} is no longer active ({state or 'expired'}"
        f"{': ' + reason if reason else ''})",
        code="rollout_not_active",
        rollout_id=rollout_id,
        state=str(state or ""),
        reason=reason or None,
    )


async def _end_at_limit(request: web.Request, b: Binding, e: LimitReached) -> Conflict:
    """End a session found past its maximum age or idle limit (before the reaper does); the
    answer says why."""
    await request.app[BINDINGS].release(b.rollout_id, b.replica_id, BindingState.ABORTED, e.reason)
    final = await _binding(request, b.rollout_id)
    return _not_active(b.rollout_id, final.state, final.reason)


# ------------------------------------------------------------------------------ endpoints


async def open_session(request: web.Request) -> web.Response:
    app = request.app
    settings = app[SETTINGS]
    body = await read_json_object(request, settings.max_body_bytes, optional=True)
    constraints = Constraints.from_headers(request.headers).merge(
        Constraints.parse(body, "session request body")
    )
    rollout_id = new_rollout_id()
    capacity = limits.pool_capacity((await app[VIEW].get()).replicas)
    admitted = await app[ADMITTER].admit(
        rollout_id,
        constraints,
        b"",
        session=True,
        lease_s=settings.session_lease_s,
        terms=limits.terms(settings, request.get(CLIENT), session=True, capacity=capacity),
    )
    adm = admitted.admission
    info = RolloutInfo.of_admission(adm)
    payload = {
        "rollout_id": adm.rollout_id,
        "generation": adm.generation,
        "label": adm.label,
        "identity_digest": adm.identity_digest,
        "replica": adm.replica_id,
        "lease_expires_ms": adm.created_ms + int(session_lease_s(settings) * 1000),
        "deadline_ms": adm.created_ms + int(settings.session_max_age_s * 1000),
    }
    return json_response(payload, status=201, headers=info.headers())


async def get_rollout(request: web.Request) -> web.Response:
    """The provenance record; one this router still holds to write (a rollout run under a
    grant, :mod:`router.records`) is written first."""
    rollout_id = request.match_info["rollout_id"]
    await shielded(request.app[RECORDER].flushed(rollout_id))
    b = await _binding(request, rollout_id)
    return json_response(
        provenance(b, lora=request.app[SETTINGS].generations == "lora"),
        headers=RolloutInfo.of_binding(b).headers(),
    )


def provenance(b: Binding, *, lora: bool) -> dict[str, object]:
    """The provenance record of ``b`` as ``GET /v1/rollouts/{id}`` answers it: the binding, and
    in a LoRA pool (``lora``) ``adapter``, the adapter its generation ran on (None: the base,
    generation 0)."""
    out: dict[str, object] = b.model_dump(mode="json")
    if lora:
        out["adapter"] = adapter_name(Generation(number=b.generation, label=b.label))
    return out


async def heartbeat(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    b = await _active_session(request, rollout_id)
    try:
        expires = await shielded(
            request.app[STORE].touch(
                rollout_id, lease_s=request.app[SETTINGS].session_lease_s, activity=False
            )
        )
    except LimitReached as e:
        raise await _end_at_limit(request, b, e) from e
    except NotFound as e:  # ended meanwhile (e.g. by a reaper at its limit): say why
        final = await _binding(request, rollout_id)
        raise _not_active(rollout_id, final.state, final.reason) from e
    return json_response({"rollout_id": rollout_id, "state": "active", "lease_expires_ms": expires})


async def close_session(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    b = await _active_session(request, rollout_id)
    verdict = await request.app[BINDINGS].release(
        rollout_id, b.replica_id, BindingState.FINISHED, "closed by client"
    )
    final = await _binding(request, rollout_id)
    if verdict is Settled.UNCONFIRMED:
        raise StoreError(f"could not close session {rollout_id}; retry")
    if verdict is Settled.ENDED_ELSEWHERE:
        raise _not_active(rollout_id, final.state)
    return json_response(
        final.model_dump(mode="json"), headers=RolloutInfo.of_binding(final).headers()
    )


# ------------------------------------------------------------------------------ forwarding


async def resolve(
    request: web.Request,
    rollout_id: str,
    constraints: Constraints,
    accept: Callable[[ReplicaRecord], bool] | None,
) -> tuple[RolloutInfo, ReplicaRecord, Settlement, int | None]:
    """Where a request of session ``rollout_id`` goes, after counting it on the binding.

    Returns the binding's provenance, its replica, what to do when the request ends and when
    the session reaches its maximum age (``deadline_ms``, Redis clock).
    """
    app = request.app
    store, bindings, settings = app[STORE], app[BINDINGS], app[SETTINGS]
    b = await _active_session(request, rollout_id)
    if not constraints.allows(b.generation):
        raise Conflict(
            f"session {rollout_id} is bound to generation {b.generation}, which does not meet "
            f"the request's constraints",
            code="generation_unsatisfiable",
            generation=b.generation,
            requested=constraints.generation,
            requested_min=constraints.min_generation,
        )
    cached = (await app[VIEW].get()).replica(b.replica_id)
    if accept is not None and cached is not None and not accept(cached):
        raise Conflict(
            f"session {rollout_id}'s replica does not serve the requested model",
            code="model_mismatch",
            rollout_id=rollout_id,
        )
    # The replica's state is read fresh (a session has no per-request ADMIT to check it), at
    # the same time as the touch that counts the request and renews the lease.
    fresh, touched = await asyncio.gather(
        shielded(store.replica(b.replica_id)),
        shielded(store.touch(rollout_id, requests=1, lease_s=settings.session_lease_s)),
        return_exceptions=True,
    )
    replica: ReplicaRecord | None = None
    if isinstance(fresh, ReplicaRecord):
        replica = fresh
    elif not isinstance(fresh, NotFound):
        raise fresh
    if replica is None or replica.state not in SERVING:
        state = "deregistered" if replica is None else str(replica.state)
        await bindings.release(rollout_id, b.replica_id, BindingState.ABORTED, f"replica {state}")
        raise Conflict(
            f"session {rollout_id}'s replica {b.replica_id} is {state}; the session "
            f"was aborted, open a new one",
            code="session_replica_unavailable",
            rollout_id=rollout_id,
            replica=b.replica_id,
            state=state,
        )
    if isinstance(touched, LimitReached):
        raise await _end_at_limit(request, b, touched) from touched
    if isinstance(touched, NotFound):
        raise _not_active(rollout_id, touched.context.get("state")) from touched
    if isinstance(touched, BaseException):
        raise touched
    settle = bindings.settlement(rollout_id, b.replica_id, session_lease_s=settings.session_lease_s)
    return RolloutInfo.of_binding(b), replica, settle, b.deadline_ms


__all__ = [
    "close_session",
    "get_rollout",
    "heartbeat",
    "open_session",
    "provenance",
    "resolve",
    "session_lease_s",
]
