"""A router's own evidence that a replica answers: passive outlier ejection.

The store says which replicas may be admitted to (I1); it cannot say that their processes still
run. With no updater alive to taint them, a replica whose server died stays READY in the store,
and every rollout admitted to it ends in a 502. :class:`PassiveHealth` keeps, per replica URL,
the connection failures this router saw in a row: after ``failures`` of them the URL is left out
of this router's choice for ``backoff_s`` (doubling with each new ejection, up to
``max_backoff_s``). Once that time is over, one admission may try it again (half-open); an
answer of any HTTP status restores it, another connection failure ejects it again.

It only ever *removes* candidates: nothing is admitted that the store's ADMIT script does not
allow, and a URL the router never saw fail is never affected. A replica that comes back at
another URL (a new process) starts with a clean record. Not thread-safe; one event loop
(:class:`~router.admission.ReplicaView` owns one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _Record:
    failures: int = 0
    ejections: int = 0
    until: float = 0.0  # monotonic: ejected until then


class PassiveHealth:
    """See the module docstring."""

    def __init__(
        self,
        failures: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self.failures = failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._records: dict[str, _Record] = {}

    def admits(self, url: str) -> bool:
        """Whether this router may choose ``url`` now. A URL whose ejection has run out is
        admitted once, and ejected again (without a new failure) until that trial answers."""
        rec = self._records.get(url)
        if rec is None or rec.failures < self.failures:
            return True
        now = self._clock()
        if now < rec.until:
            return False
        rec.until = now + self._backoff(rec.ejections)  # one trial per backoff window
        return True

    def failed(self, url: str) -> None:
        """A connection to ``url`` failed (refused, reset before an answer, unreachable)."""
        rec = self._records.setdefault(url, _Record())
        rec.failures += 1
        if rec.failures >= self.failures:
            rec.ejections += 1
            rec.until = self._clock() + self._backoff(rec.ejections - 1)
            log.warning(
                "replica at %s left out of this router's choice for %.1f s after %d "
                "connection failures in a row",
                url,
                rec.until - self._clock(),
                rec.failures,
            )

    def answered(self, url: str) -> None:
        """``url`` answered (any HTTP status): its record is cleared."""
        if self._records.pop(url, None) is not None:
            log.info("replica at %s answers again", url)

    def ejected(self) -> list[str]:
        """The URLs left out of the choice now."""
        now = self._clock()
        return sorted(
            u for u, r in self._records.items() if r.failures >= self.failures and now < r.until
        )

    def _backoff(self, ejections: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2.0**ejections)


__all__ = ["PassiveHealth"]
