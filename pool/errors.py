"""The RolloutPool error tree, split by recovery boundary.

::

    RolloutPoolError
    ├── LifecycleError                  the controller refused; the replica's state is unchanged
    │   ├── IllegalTransition           this event is not accepted in this state
    │   └── PostconditionFailed         the evidence does not prove the step's postcondition
    ├── StoreError
    │   ├── StoreUnavailable            Redis unreachable: admissions fail closed
    │   │   ├── StoreBusy               Redis is up, but no pooled connection freed up in time
    │   │   └── NotReplicated           a write reached the primary but not its replicas in time
    │   ├── EpochChanged                Redis failed over while a step relied on the old primary
    │   ├── StoreConflict               a compare-and-set lost (state moved, stale fencing token)
    │   │   └── StaleFencingToken       the writer no longer holds the updater lease
    │   ├── AdmissionRefused            no admission on this replica (with a machine reason)
    │   └── NotFound                    unknown replica / rollout / generation
    │       └── LimitReached            a binding reached its max age or idle limit
    ├── EngineError                     an operation on a vLLM server failed
    │   ├── NoMutation                  proved: the engine's weights/caches were not touched
    │   └── AmbiguousMutation           the engine may be half-changed → TAINTED
    ├── DeadlineExceeded                a step overran its deadline (ambiguous for mutating steps)
    └── PreflightFailed                 a checkpoint was refused before any mutation

Router and updater subclass these; HTTP status codes are assigned only in their error middlewares.
"""

from __future__ import annotations

import asyncio
from typing import Any


class RolloutPoolError(Exception):
    """Root of every error RolloutPool raises on purpose. A subclass names its ``code`` in its
    bases (``class NotFound(StoreError, code="not_found")``); one that does not inherits it."""

    code: str = "rolloutpool_error"

    def __init_subclass__(cls, *, code: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if code is not None:
            cls.code = code

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready body: ``{"error": {"code", "message", ...context}}``."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        body.update({k: v for k, v in self.context.items() if v is not None})
        return {"error": body}


class LifecycleError(RolloutPoolError, code="lifecycle_error"): ...


class IllegalTransition(LifecycleError, code="illegal_transition"): ...


class PostconditionFailed(LifecycleError, code="postcondition_failed"): ...


class StoreError(RolloutPoolError, code="store_error"): ...


class StoreUnavailable(StoreError, code="store_unavailable"): ...


class StoreBusy(StoreUnavailable, code="store_busy"):
    """This process's Redis connections were all in use for ``pool_timeout_s``: Redis itself is
    fine (retry soon), but admissions still fail closed."""


class NotReplicated(StoreUnavailable, code="store_not_replicated"):
    """A fenced write reached the primary but not ``wait_replicas`` replicas within
    ``wait_timeout_s``: a failover could still lose it, so nothing may act on it."""


class EpochChanged(StoreError, code="store_epoch_changed"):
    """Redis failed over (a new failover epoch) between a check and the step that relied on
    it; the step must not proceed on the old evidence."""


class StoreConflict(StoreError, code="store_conflict"): ...


class StaleFencingToken(StoreConflict, code="stale_fencing_token"): ...


class AdmissionRefused(StoreError, code="admission_refused"):
    """Admission to one replica was refused; ``reason`` is a stable machine-readable word."""

    def __init__(self, reason: str, message: str | None = None, **context: Any) -> None:
        super().__init__(message or f"admission refused: {reason}", reason=reason, **context)
        self.reason = reason


class NotFound(StoreError, code="not_found"): ...


class LimitReached(NotFound, code="limit_reached"):
    """A binding reached its maximum age or idle limit: it may no longer be used (its lease
    cannot be extended), and ends with ``reason`` (by the caller, or by the reaper)."""

    def __init__(self, message: str, *, reason: str, **context: Any) -> None:
        super().__init__(message, reason=reason, **context)
        self.reason = reason


class EngineError(RolloutPoolError, code="engine_error"):
    """A vLLM control-plane call failed. Prefer the two subclasses, which say what is known."""


class NoMutation(EngineError, code="no_mutation"):
    """The call failed in a way that proves nothing was mutated (refused, never sent, 4xx)."""


class AmbiguousMutation(EngineError, code="ambiguous_mutation"):
    """The call may have mutated the engine (timeout mid-call, 5xx during a transfer, death)."""


class DeadlineExceeded(RolloutPoolError, code="deadline_exceeded"): ...


class PreflightFailed(RolloutPoolError, code="preflight_failed"):
    """A checkpoint was refused before any mutation (missing path, manifest or identity)."""


def raise_if_cancelling(err: BaseException | None, since: int = 0) -> None:
    """Re-raise the current task's pending cancellation in place of ``err`` (None: of a call
    that returned normally), if it has more than ``since`` pending cancellations (its
    ``cancelling()`` counted before the call: one delivered and caught earlier does not count).

    A Redis call cut by its task's cancellation can report a lost connection instead (redis-py
    closes the connection on the way out), or even return normally (on Python 3.11 its write
    goes through ``asyncio.wait_for``: CPython gh-86296). A loop that waits out outages must
    call this first: otherwise it swallows the cancellation and never ends."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > since:
        raise asyncio.CancelledError() from err
