"""Limits on what one client may hold in this router: requests in flight per client identity and
per session (:class:`InFlight`), the terms a client's rollouts are admitted on (:func:`terms`:
owner, a session's maximum age and idle limit, the client's session quota) and the deadline of
a request (:class:`Deadline`).

The in-flight counts are this router's own, exact (taken and given back synchronously, with no
await in between), and held from a request's arrival (queueing for a replica included) to its
last byte. With N routers a client may have up to N times ``client_max_in_flight`` requests in
flight; open sessions are counted in Redis (``Terms.quota``), across every router.

The admin token is exempt from the client limits: it is the operator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from pool.store import Terms
from router.errors import QuotaExceeded
from router.settings import RouterSettings

ADMIN = "admin"


def terms(settings: RouterSettings, client: str | None, *, session: bool) -> Terms:
    """What a rollout of ``client`` is admitted on. It is owned by the client when client keys
    are configured (anonymous callers share one data plane: no owner); a session also gets the
    maximum age, the idle limit and, unless the admin opens it, the client's session quota."""
    owner = client if client is not None and client.startswith(("key:", ADMIN)) else ""
    if not session:
        return Terms(owner=owner)
    quota = 0 if client in (None, ADMIN) else settings.client_max_sessions
    return Terms(
        owner=owner,
        max_age_s=settings.session_max_age_s,
        idle_s=settings.session_idle_s,
        quota_key=client or "",
        quota=quota,
    )


class InFlight:
    """Requests in flight in this router, per client identity and per session."""

    def __init__(self, settings: RouterSettings) -> None:
        self.per_client = settings.client_max_in_flight
        self.per_session = settings.session_max_in_flight
        self.retry_after = str(settings.retry_after_s)
        self.clients: Counter[str] = Counter()
        self.sessions: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, client: str | None, session: str | None) -> Iterator[None]:
        """Count one request of ``client`` (of ``session``, if any) for the block; raise
        :class:`QuotaExceeded` (429 ``client_in_flight`` / ``session_busy``) if it is over."""
        client = None if client == ADMIN else client
        if client is not None and self.per_client and self.clients[client] >= self.per_client:
            raise QuotaExceeded(
                f"client {client} has {self.per_client} requests in flight in this router, its "
                f"limit (client_max_in_flight); wait for one to finish",
                code="client_in_flight",
                headers={"Retry-After": self.retry_after},
                limit=self.per_client,
            )
        if session is not None and self.per_session and self.sessions[session] >= self.per_session:
            raise QuotaExceeded(
                f"session {session} already has {self.per_session} request(s) in flight, its "
                f"limit (session_max_in_flight); send its requests one after another",
                code="session_busy",
                headers={"Retry-After": self.retry_after},
                limit=self.per_session,
            )
        if client is not None:
            self.clients[client] += 1
        if session is not None:
            self.sessions[session] += 1
        try:
            yield
        finally:
            if client is not None:
                _decrement(self.clients, client)
            if session is not None:
                _decrement(self.sessions, session)


def _decrement(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


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
