"""Limits on what one client may hold: the per-client quotas (:func:`session_quota`,
:func:`in_flight_limit`: explicit, or derived from the pool's capacity), the terms a client's
rollouts are admitted on (:func:`terms`: owner, a session's maximum age and idle limit, the
client's session quota), requests in flight per client identity in this router
(:class:`InFlight`), the sequences a request asks the replica for (:func:`sequences`) and the
deadline of a request (:class:`Deadline`). One session's concurrent requests are limited in
Redis, across workers and routers (:mod:`router.session_runs`).

**Derived quotas.** ``client_max_sessions`` and ``client_max_in_flight`` left unset are derived
from the pool's capacity as this router's view has it at admission (:func:`pool_capacity`: the
capacity of every replica in service or coming back from an update, so a rolling update does
not move it): open sessions per client, half of it (at least 1), since a session holds its slot
while it idles between requests, so one client can never hold the whole pool with idle sessions;
requests in flight per client in one router, the whole of it (a request is work that ends
within ``request_deadline_s``, and one trainer alone must be able to fill the pool; more than
the pool can run would only queue), no limit while the router sees no capacity at all.

The in-flight counts are this router's own, exact (taken and given back synchronously, with no
await in between), and held from a request's arrival (queueing for a replica included) to its
last byte. With N routers a client may have up to N times its in-flight limit; open sessions
are counted in Redis (``Terms.quota``), across every router.

The admin token is exempt from the client limits: it is the operator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pool.store import Terms
from pool.types import ReplicaRecord, ReplicaState
from pool.web import BadRequest, dumps
from router.errors import QuotaExceeded
from router.settings import RouterSettings

ADMIN = "admin"

#: Replicas whose capacity is not the pool's: not serving yet, failed, or being recovered.
OUT_OF_SERVICE = frozenset(
    {ReplicaState.UNINITIALIZED, ReplicaState.TAINTED, ReplicaState.RECOVERING}
)


def pool_capacity(replicas: Iterable[ReplicaRecord]) -> int:
    """The pool's capacity: the sum of the capacity of every replica not out of service
    (:data:`OUT_OF_SERVICE`)."""
    return sum(r.capacity for r in replicas if r.state not in OUT_OF_SERVICE)


def session_quota(settings: RouterSettings, capacity: int) -> int:
    """Open sessions a client may have: ``client_max_sessions``, or, unset, half the pool's
    ``capacity`` (at least 1). 0: no quota."""
    if settings.client_max_sessions is not None:
        return settings.client_max_sessions
    return max(1, capacity // 2)


def in_flight_limit(settings: RouterSettings, capacity: int) -> int:
    """Requests a client may have in flight in this router: ``client_max_in_flight``, or,
    unset, the pool's ``capacity``. 0: no limit (unset, while the router sees no capacity: a
    request then waits for a replica, and is answered 503 with the reason if none comes)."""
    if settings.client_max_in_flight is not None:
        return settings.client_max_in_flight
    return capacity


def terms(
    settings: RouterSettings, client: str | None, *, session: bool, capacity: int = 0
) -> Terms:
    """What a rollout of ``client`` is admitted on. It is owned by the client when client keys
    are configured (anonymous callers share one data plane: no owner); a session also gets the
    maximum age, the idle limit and, unless the admin opens it, the client's session quota
    (:func:`session_quota` of the pool's ``capacity``)."""
    owner = client if client is not None and client.startswith(("key:", ADMIN)) else ""
    if not session:
        return Terms(owner=owner)
    quota = 0 if client in (None, ADMIN) else session_quota(settings, capacity)
    return Terms(
        owner=owner,
        max_age_s=settings.session_max_age_s,
        idle_s=settings.session_idle_s,
        quota_key=client or "",
        quota=quota,
    )


class InFlight:
    """Requests in flight in this router, per client identity."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.retry_after = str(settings.retry_after_s)
        self.clients: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, client: str | None, capacity: int) -> Iterator[None]:
        """Count one request of ``client`` for the block; raise :class:`QuotaExceeded` (429
        ``client_in_flight``) if it is over :func:`in_flight_limit` of the pool's
        ``capacity``."""
        client = None if client == ADMIN else client
        if client is None:
            yield
            return
        limit = in_flight_limit(self.settings, capacity)
        if limit and self.clients[client] >= limit:
            raise QuotaExceeded(
                f"client {client} has {limit} requests in flight in this router, its limit "
                f"(client_max_in_flight); wait for one to finish",
                code="client_in_flight",
                headers={"Retry-After": self.retry_after},
                limit=limit,
            )
        self.clients[client] += 1
        try:
            yield
        finally:
            self.clients[client] -= 1
            if self.clients[client] <= 0:
                del self.clients[client]


@dataclass(frozen=True)
class Sequences:
    """The sequences one request asks its replica for: ``count`` (at least 1), the fields that
    make it more than one (``fields``, e.g. ``("n", "prompt")``; empty when it is one) and the
    same in words (``why``, e.g. ``("'n' = 4", "'prompt' is a list of 2 prompts")``)."""

    count: int = 1
    fields: tuple[str, ...] = ()
    why: tuple[str, ...] = ()

    def one_per_request(self, where: str) -> BadRequest:
        """400 ``one_sequence_per_request``: ``where`` (a session's request, ...) is charged one
        slot of its replica, so it may ask for one sequence only."""
        return BadRequest(
            f"{where} is charged one slot of its replica, so it may ask for one sequence only; "
            f"this one asks for {self.count} ({', '.join(self.why)}): send them as separate "
            f"requests",
            code="one_sequence_per_request",
            fields=list(self.fields),
            sequences=self.count,
        )

    def too_many(self, largest: int) -> BadRequest:
        """400 ``too_many_sequences``: more sequences than any replica's capacity."""
        return BadRequest(
            f"the request asks for {self.count} sequences ({', '.join(self.why)}), more than "
            f"any replica runs at once (the largest capacity is {largest}): split it",
            code="too_many_sequences",
            fields=list(self.fields),
            sequences=self.count,
            limit=largest,
        )


def _positive(params: Mapping[str, Any], name: str, shown: str) -> int:
    value = params.get(name)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(
            f"'{shown}' must be a positive integer, not {dumps(value)[:40]}",
            code="invalid_body",
            field=shown,
        )
    return value


def sequences(route: str, body: Mapping[str, Any]) -> Sequences:
    """How many sequences a replica generates for ``body`` on ``route``: per prompt the larger
    of ``n`` and ``best_of`` (each 1 by default; ``sampling_params.n`` and
    ``sampling_params.best_of`` on ``/inference/v1/generate``), times the prompts
    (``/v1/completions``: a list of strings or of token-id lists is that many; one string or
    one token-id list is one). 400 ``invalid_body`` naming the field when ``n`` or ``best_of``
    is not a positive integer (a replica could read ``"4"`` as 4 where the router counted 1)."""
    params: Mapping[str, Any] = body
    prefix = ""
    if route == "/inference/v1/generate":
        sampling = body.get("sampling_params")
        params = sampling if isinstance(sampling, dict) else {}
        prefix = "sampling_params."
    fields: list[str] = []
    why: list[str] = []
    per_prompt = 1
    for name in ("n", "best_of"):
        value = _positive(params, name, prefix + name)
        if value > 1:
            fields.append(prefix + name)
            why.append(f"'{prefix}{name}' = {value}")
        per_prompt = max(per_prompt, value)
    prompts = 1
    prompt = body.get("prompt") if route == "/v1/completions" else None
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        prompts = len(prompt)
        if prompts > 1:
            fields.append("prompt")
            why.append(f"'prompt' is a list of {prompts} prompts")
    return Sequences(per_prompt * prompts, tuple(fields), tuple(why))


def check_sequences(
    seqs: Sequences, *, session: bool, grants: bool, replicas: Iterable[ReplicaRecord]
) -> None:
    """400 unless a request asking for ``seqs`` can be charged for them: more than one only for
    a one-request rollout under ``grants`` (one slot per sequence; a session's binding, or a
    one-request binding with grants off, is one slot), and never more than the largest
    capacity of a replica in service (none of them could ever admit it)."""
    if seqs.count == 1:
        return
    if session:
        raise seqs.one_per_request("a session's request")
    if not grants:
        raise seqs.one_per_request("with grants off, a request")
    largest = max((r.capacity for r in replicas if r.state not in OUT_OF_SERVICE), default=0)
    if largest and seqs.count > largest:
        raise seqs.too_many(largest)


@dataclass(frozen=True)
class Deadline:
    """When a request must have ended (event-loop time) and the reason it is aborted with then."""

    at: float
    reason: str

    @classmethod
    def of_request(cls, settings: RouterSettings) -> Deadline:
        """``request_deadline_s`` from now (call on arrival)."""
        limit = settings.request_deadline_s
        at = asyncio.get_running_loop().time() + limit
        return cls(at, f"request deadline of {limit:g} s exceeded")

    def capped(self, deadline_ms: int | None) -> Deadline:
        """No later than a session's own maximum age (``deadline_ms``, Redis clock, read against
        this host's clock: a skew moves the cut; the reaper ends the session on time)."""
        if deadline_ms is None:
            return self
        left = deadline_ms / 1000 - time.time()
        at = asyncio.get_running_loop().time() + left
        if at >= self.at:
            return self
        return Deadline(at, "session reached its maximum age")
