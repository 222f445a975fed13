"""What an admission binds besides the replica: owner, maximum age, idle limit, session quota."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Terms:
    """What an admission binds besides the replica (all optional):

    * ``owner`` — the client identity that may use the rollout ('' = anyone);
    * ``max_age_s`` — a hard end: the lease is never extended past ``created + max_age_s``;
    * ``idle_s`` — the lease is never extended past the last request (not heartbeat) plus
      ``idle_s``;
    * ``quota_key``, ``quota`` — admit only while the client ``quota_key`` has fewer than
      ``quota`` open sessions (0: no quota); counted in Redis, so across every router.

    A binding that reaches its max age or idle limit expires and the reaper ends it with a
    reason that says which (:meth:`pool.store.RedisStore.reap_expired`).
    """

    owner: str = ""
    max_age_s: float | None = None
    idle_s: float | None = None
    quota_key: str = ""
    quota: int = 0


NO_TERMS = Terms()


def limit_reason(kind: str, limit_ms: int) -> str:
    """The reason a binding ends with when it reached a limit of its :class:`Terms`."""
    if kind == "max_age":
        return f"session reached its maximum age of {limit_ms / 1000:g} s"
    return f"session idle: no request for {limit_ms / 1000:g} s"
