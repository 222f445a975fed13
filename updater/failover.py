"""The updater's side of a Redis failover (docs: operations/failover.md).

A failover can lose bindings the old primary had acknowledged; the routers that hold their
requests find out in the new failover epoch and cut them (:mod:`router.failover`). Until they
have, the store's count of active bindings may be too low, so the :class:`EpochGate` stands
before every weight transfer:

* :meth:`EpochGate.settled` blocks until the epoch is settled (no failover under way) and every
  live router has verified it.
  A router that cannot verify (Redis unreachable) stops counting once its heartbeat expires
  (``failover_grace_s``), and by then it has cut its own requests (it does so after half that
  long), so the wait is bounded by ``failover_grace_s``.
* :meth:`EpochGate.unchanged` re-reads the epoch after the QUIESCED → UPDATING commit (which the
  store made only with zero active bindings, and durable with ``wait_replicas``): if Redis
  failed over in between, the count it checked may be one a failover lost, and the transfer
  must not start (:class:`~pool.errors.EpochChanged`).

In steady state this costs two reads per replica update. Reconciling the controller with the
store after a lost transition is the supervisor's job (:mod:`updater.supervisor`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pool.errors import EpochChanged, StoreUnavailable, raise_if_cancelling
from pool.store import Epoch, RedisStore

log = logging.getLogger(__name__)


class EpochGate:
    """See the module docstring. Safe for concurrent cycles."""

    def __init__(
        self, store: RedisStore, poll_s: float = 0.1, timeout_s: float | None = None
    ) -> None:
        self.store = store
        self.poll_s = poll_s
        #: past this (default: 3 x failover_grace_s) ``settled`` gives up: StoreUnavailable
        self.timeout_s = timeout_s or 3 * store.settings.failover_grace_s
        #: seconds spent waiting for routers, per epoch (reported in bench/redis_failover)
        self.waited_s: dict[int, float] = {}

    async def settled(self) -> Epoch:
        """The current epoch, once it is settled and every live router has verified it (see
        the module doc); StoreUnavailable after ``timeout_s``. Redis being unreachable for a
        moment (e.g. the first call on a pooled connection after a restart) is waited out like
        an unsettled epoch, within the same ``timeout_s``; never a cancellation, whatever error
        the cancelled call raised."""
        t0 = time.monotonic()
        while True:
            try:
                epoch = await self.store.failover.epoch()
                routers = await self.store.failover.routers()
            except StoreUnavailable as err:
                raise_if_cancelling(err)  # a deadline around this wait must end it
                if time.monotonic() - t0 > self.timeout_s:
                    raise
                log.info("failover check: %s; trying again", err)
                await asyncio.sleep(self.poll_s)
                continue
            behind = sorted(rid for rid, e in routers.items() if e < epoch.number)
            if epoch.settled and not behind:
                if time.monotonic() - t0 > self.poll_s:
                    waited = time.monotonic() - t0
                    self.waited_s[epoch.number] = waited
                    log.info("routers verified epoch %d after %.2f s", epoch.number, waited)
                return epoch
            if time.monotonic() - t0 > self.timeout_s:
                raise StoreUnavailable(
                    f"failover epoch {epoch.number} not settled or not verified by routers "
                    f"{behind} within {self.timeout_s:g} s"
                )
            await asyncio.sleep(self.poll_s)

    async def unchanged(self, epoch: Epoch) -> None:
        """Raise :class:`EpochChanged` if Redis failed over since ``epoch`` was read."""
        now = await self.store.failover.epoch()
        if now.number != epoch.number or not now.settled:
            raise EpochChanged(
                f"Redis failed over (epoch {epoch.number} -> {now.number}) during the step",
                before=epoch.number,
                after=now.number,
            )


__all__ = ["EpochGate"]
