"""This router's capacity grants: one-request rollouts admitted with no Redis round trip.

The store side and the argument for I1/I2 are in :mod:`pool.store.grants`. Here:

* :meth:`GrantBook.take` admits one rollout against a held grant: synchronous, no I/O. It
  takes a slot per sequence the request asks for, only from a grant that is open (the view
  says the replica is READY on the grant's generation, admissible, and its grants are not
  aborted) while this router's registration is alive (:meth:`GrantBook.live`: a heartbeat
  sent less than half of ``failover_grace_s`` ago, and an epoch verified).
* :meth:`GrantBook.settle` is what a release proves, decided locally: ``CONFIRMED`` when the
  request was not cut, the grant not aborted and the registration still alive (then no weight
  can have changed under the grant: a drain waits for it, and a grant outlives a dead router
  by at most ``failover_grace_s``, past which this router has cut everything itself);
  ``ENDED_ELSEWHERE`` when the grant was aborted or dropped; ``UNCONFIRMED`` when the
  registration may have lapsed. The proxy delivers only confirmed output, as with bindings.
* The keeper (:meth:`GrantBook.keep`, a background loop on a flag) holds a grant of
  ``grant_slots`` on every open replica in advance, grows one whose slots are three quarters
  in use, shrinks one that stayed at most half used for :data:`SHRINK_AFTER` rounds, and
  returns a closed one once nothing runs under it. :meth:`on_view` (the change feed) closes
  grants at once when their replica leaves READY or its generation stops being admissible,
  and cuts what runs under an aborted one.
* :meth:`fence` (the failover guard could not heartbeat) cuts everything and forgets every
  grant; :meth:`drop` forgets one grant a failover lost (its requests are cut).

Concurrency: one event loop; :meth:`take`, :meth:`put`, :meth:`settle` and :meth:`on_view` never
await, so a slot is counted the moment it is taken. Store calls (grow, shrink, return) run
only in the keeper or when a request finds no free slot (not the steady state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pool.errors import AdmissionRefused, StoreError
from pool.store import RedisStore
from pool.store.grants import Grant
from pool.types import Generation, ReplicaRecord, ReplicaState
from router.bindings import Held, Settled, cut_tasks

log = logging.getLogger("router")

#: Keeper rounds (about a second each) a grant must stay at most half used before it shrinks:
#: a burst after a lull finds the slots it had, instead of growing them on its requests' path.
SHRINK_AFTER = 60


@dataclass
class LocalGrant:
    """A grant this router holds, and what runs under it."""

    grant: Grant
    in_use: int = 0
    peak: int = 0  # the most slots in use since the keeper last looked
    quiet: int = 0  # keeper rounds in a row in which at most half the slots were in use
    open: bool = True  # new admissions allowed (the view says READY, admissible, not aborted)
    aborted: str | None = None  # why what runs under it was cut
    returning: bool = False  # being returned: never opens again
    running: dict[str, Held] = field(default_factory=dict)  # rollout id -> its request
    epoch: int | None = None  # the failover epoch it was last proven in

    @property
    def replica_id(self) -> str:
        return self.grant.replica_id

    @property
    def free(self) -> int:
        return self.grant.slots - self.in_use


class GrantBook:
    """See the module docstring."""

    def __init__(
        self,
        store: RedisStore,
        router_id: str,
        *,
        slots: int,
        max_staleness: int,
        grace_s: float,
    ) -> None:
        self.store = store
        self.router_id = router_id
        self.slots = slots
        self.max_staleness = max_staleness
        self.grace_s = grace_s
        self.grants: dict[str, LocalGrant] = {}
        #: monotonic time the last successful heartbeat was sent (set by the failover guard)
        self.registered_at: float | None = None
        #: the failover epoch this router verified (set by the failover guard)
        self.epoch: int | None = None
        self._records: dict[str, ReplicaRecord] = {}
        self._latest: Generation | None = None
        self._wake = asyncio.Event()
        #: grants forgotten with requests still under them: returned once those have ended
        self._orphans: list[LocalGrant] = []

    # ------------------------------------------------------------------ the request's path

    def registered(self, epoch: int, sent: float) -> int:
        """A heartbeat sent at ``sent`` (monotonic) succeeded in ``epoch``. If the one before it
        was sent half of ``failover_grace_s`` or more earlier (this process was frozen, or
        Redis away), the registration may have lapsed in between and the grants been reclaimed
        under it: everything under them is cut and they are forgotten (:meth:`fence`) before
        the new registration counts. Returns how many requests were cut."""
        previous, self.registered_at, self.epoch = self.registered_at, sent, epoch
        if previous is None or sent - previous < self.grace_s / 2:
            return 0
        return self.fence(
            f"this router's registration may have lapsed ({sent - previous:.1f} s between "
            "heartbeats); its grants may have been reclaimed"
        )

    def live(self) -> bool:
        """Whether this router's registration (what its grants live on) is surely alive."""
        at = self.registered_at
        return (
            self.epoch is not None and at is not None and time.monotonic() - at < self.grace_s / 2
        )

    def take(self, replica_id: str, generation: int, slots: int = 1) -> LocalGrant | None:
        """``slots`` slots (a request's sequences, :func:`router.limits.sequences`) of the open
        grant on ``replica_id`` at ``generation``, or None."""
        lg = self.grants.get(replica_id)
        if (
            lg is None
            or not lg.open
            or lg.free < slots
            or lg.grant.generation != generation
            or not self.live()
        ):
            return None
        lg.in_use += slots
        lg.peak = max(lg.peak, lg.in_use)
        if lg.free <= lg.grant.slots // 4:
            self._wake.set()  # nearly full: the keeper grows it before a request waits
        return lg

    def run(self, lg: LocalGrant, rollout_id: str, held: Held) -> None:
        """Register the request running under ``lg`` (so that an abort can cut it)."""
        lg.running[rollout_id] = held
        if lg.aborted is not None:
            cut_tasks(held, lg.aborted)

    def settle(self, lg: LocalGrant, rollout_id: str) -> Settled:
        """What the end of a request under ``lg`` proves (module docstring); the slot stays
        taken until :meth:`put`."""
        held = lg.running.get(rollout_id)
        if (held is not None and held.cut is not None) or lg.aborted is not None:
            return Settled.ENDED_ELSEWHERE
        if self.grants.get(lg.replica_id) is not lg:
            return Settled.ENDED_ELSEWHERE  # dropped (a failover lost it, or fenced)
        return Settled.CONFIRMED if self.live() else Settled.UNCONFIRMED

    def put(self, lg: LocalGrant, rollout_id: str, slots: int = 1) -> None:
        """Give the ``slots`` taken back (after delivery); a closed grant with nothing left is
        returned."""
        lg.running.pop(rollout_id, None)
        lg.in_use -= slots
        if lg.in_use == 0 and (not lg.open or self.grants.get(lg.replica_id) is not lg):
            self._wake.set()

    async def grow(self, replica_id: str, slots: int = 1) -> None:
        """Get (or enlarge) the grant on ``replica_id`` now: a request found fewer than
        ``slots`` free. Raises :class:`AdmissionRefused` / :class:`StoreError`."""
        lg = self.grants.get(replica_id)
        in_use = 0 if lg is None else lg.in_use
        want = max(self.slots if lg is None else lg.grant.slots * 2, in_use + slots)
        await self._resize(replica_id, want)

    # ------------------------------------------------------------------ the view

    def on_view(self, records: Mapping[str, ReplicaRecord], latest: Generation | None) -> None:
        """The pool view changed: close grants whose replica left READY or whose generation is
        no longer admissible; cut what runs under aborted ones."""
        self._records, self._latest = dict(records), latest
        for rid, lg in self.grants.items():
            rec = records.get(rid)
            reason = self._closed(rec, lg.grant.generation)
            lg.open = reason is None and not lg.returning
            if rec is not None and rec.grants_aborted and lg.aborted is None:
                lg.aborted = f"its replica's grants were aborted: {rec.grants_aborted}"
                for held in list(lg.running.values()):
                    cut_tasks(held, lg.aborted)
            if not lg.open:
                self._wake.set()
        self._wake.set()

    def _closed(self, rec: ReplicaRecord | None, generation: int) -> str | None:
        if rec is None:
            return "unknown replica"
        if rec.state is not ReplicaState.READY or rec.generation != generation:
            return f"{rec.state} g{rec.generation}"
        if rec.grants_aborted:
            return "grants aborted"
        latest = self._latest
        if latest is None or generation < latest.number - self.max_staleness:
            return "stale generation"
        return None

    # ------------------------------------------------------------------ failover

    def fence(self, reason: str) -> int:
        """Cut everything running under grants and forget every grant (the registration may
        lapse: a grant this router cannot prove is no capacity)."""
        n = 0
        for lg in self.grants.values():
            lg.aborted = reason
            for held in list(lg.running.values()):
                n += cut_tasks(held, reason)
        self._orphans += self.grants.values()
        self.grants.clear()
        return n

    def drop(self, replica_id: str, reason: str) -> int:
        """Forget one grant (a failover lost it) and cut what runs under it."""
        lg = self.grants.pop(replica_id, None)
        if lg is None:
            return 0
        lg.aborted = reason
        self._orphans.append(lg)
        return sum(cut_tasks(held, reason) for held in list(lg.running.values()))

    async def close(self) -> None:
        """Return every grant (the router is stopping; best effort: a grant not returned lapses
        with the router's registration)."""
        for rid in [*self.grants, *(o.replica_id for o in self._orphans)]:
            with contextlib.suppress(StoreError):
                await self.store.grants.give_back(self.router_id, rid)
        self.grants.clear()
        self._orphans.clear()

    # ------------------------------------------------------------------ the keeper

    async def keep(self, stop: asyncio.Event, tick_s: float = 1.0) -> None:
        """Size, acquire and return grants until ``stop`` is set (module docstring); woken at
        once by a view change or a nearly full grant, else every ``tick_s``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick_s)
            self._wake.clear()
            if stop.is_set():
                break
            try:
                await self._tend()
            except StoreError as e:
                log.warning("grant keeper: %s", e.message)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), tick_s)

    async def _tend(self) -> None:
        # a grant is forgotten only once Redis confirmed its return (a failed call is retried
        # next round: a grant left behind would hold its replica's drain while this router lives)
        for lg in [o for o in self._orphans if o.in_use == 0]:
            if lg.replica_id not in self.grants:
                await self.store.grants.give_back(self.router_id, lg.replica_id)
            self._orphans.remove(lg)
        for lg in list(self.grants.values()):  # returns first: a drain waits for them
            if not lg.open and lg.in_use == 0:
                await self._give_back(lg)  # no slot is taken from it again, whatever the view says
        for rid, lg in list(self.grants.items()):
            if not lg.open:
                continue
            lg.quiet = lg.quiet + 1 if lg.peak * 2 < lg.grant.slots else 0
            # a refusal (at capacity, or the replica just left READY) leaves the grant as it is
            with contextlib.suppress(AdmissionRefused):
                if lg.free <= lg.grant.slots // 4:
                    await self._resize(rid, lg.grant.slots * 2)
                elif lg.quiet >= SHRINK_AFTER and lg.grant.slots > self.slots:
                    await self._resize(rid, max(self.slots, lg.peak * 2, lg.in_use))
                    lg.quiet = 0
            lg.peak = lg.in_use
        if not self.live():
            return
        for rid, rec in self._records.items():
            gen = rec.generation
            if rid not in self.grants and gen is not None and self._closed(rec, gen) is None:
                with contextlib.suppress(AdmissionRefused):
                    await self._resize(rid, self.slots)

    async def _resize(self, replica_id: str, want: int) -> None:
        """Set this router's slots on ``replica_id`` to ``want`` (at most its capacity).

        Redis keeps one grant per router and replica, with the generation it was given on:
        what a retire of a LoRA pool's old adapter must keep loaded (:mod:`pool.store.adapters`).
        So a grant held since before the replica moved to another generation (a LoRA pool's
        replicas move with no drain) is returned first, once nothing runs under it, and the new
        one is given on the replica's generation; while something still runs under the old one,
        nothing is granted."""
        rec = self._records.get(replica_id)
        if rec is not None:
            want = min(want, rec.capacity)
        lg = self.grants.get(replica_id)
        if lg is not None and rec is not None and lg.grant.generation != rec.generation:
            if lg.in_use:
                return
            await self._give_back(lg)
        g = await self.store.grants.grant(
            self.router_id, replica_id, want, max_staleness=self.max_staleness
        )
        # the grant as it is now, not as it was before the call: a resize that ran meanwhile
        # (two requests that found no free slot) may have put a fresh one in place, with
        # requests already running under it
        lg = self.grants.get(replica_id)
        if lg is not None and lg.grant.generation == g.generation:
            lg.grant = g
            return
        if lg is not None:
            # the replica moved on during the call (the view was behind Redis): Redis's grant
            # still holds lg's generation; it is returned once nothing runs under it, and the
            # next resize grants anew
            if not lg.in_use:
                await self._give_back(lg)
            return
        fresh = self.grants[replica_id] = LocalGrant(g, epoch=self.epoch)
        fresh.open = self._closed(rec, g.generation) is None

    async def _give_back(self, lg: LocalGrant) -> None:
        """Return an idle grant (no slot is taken from it again) and forget it."""
        lg.returning = True
        lg.open = False
        await self.store.grants.give_back(self.router_id, lg.replica_id)
        if self.grants.get(lg.replica_id) is lg:
            del self.grants[lg.replica_id]


__all__ = ["GrantBook", "LocalGrant"]
