"""The rolling plan: which replica to update next. Pure functions over store records.

Rules (one update, target generation ``g``):

* only READY replicas not yet on ``g`` are candidates; TAINTED / recovering ones are left to
  recovery, which brings them up on the latest generation anyway;
* shortest drain first: fewest active bindings, then replica id (stable);
* at most ``max_unavailable`` replicas out of READY at once (counting ones already out);
* never fewer than ``min_serving`` admitting replicas: draining a candidate must leave at least
  ``min_serving`` READY replicas that admit (on the latest generation, within ``max_staleness``)
  — except that where ``min_serving`` can never be met (it is at least the number of replicas,
  e.g. a pool of one), one replica at a time may go.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pool.lifecycle import IN_UPDATE
from pool.types import ReplicaRecord, ReplicaState

S = ReplicaState


def admitting(records: Sequence[ReplicaRecord], latest: int, max_staleness: int) -> list[str]:
    return [
        r.replica_id
        for r in records
        if r.state is S.READY
        and r.generation is not None
        and r.generation >= latest - max_staleness
    ]


def next_batch(
    records: Sequence[ReplicaRecord],
    target: int,
    latest: int | None,
    *,
    max_unavailable: int = 1,
    min_serving: int = 1,
    max_staleness: int = 0,
    exclude: Collection[str] = (),
) -> list[str]:
    """Replica ids to start updating now (possibly empty: wait and ask again). Replicas in
    ``exclude`` (already tried in this update) are never chosen but still count as serving."""
    out_now = sum(1 for r in records if r.state in IN_UPDATE)
    room = max_unavailable - out_now
    if room <= 0:
        return []
    candidates = sorted(
        (
            r
            for r in records
            if r.state is S.READY and r.generation != target and r.replica_id not in exclude
        ),
        key=lambda r: (r.active, r.replica_id),
    )
    serving = set(admitting(records, latest if latest is not None else -1, max_staleness))
    chosen: list[str] = []
    for r in candidates:
        if len(chosen) >= room:
            break
        left = serving - {r.replica_id} - set(chosen)
        lone = len(records) <= min_serving and not chosen
        if len(left) < min_serving and not lone:
            continue
        chosen.append(r.replica_id)
    return chosen


def done(records: Sequence[ReplicaRecord], target: int) -> bool:
    """True when every replica that is not TAINTED/RECOVERING/UNINITIALIZED is on ``target``."""
    return all(
        r.generation == target and r.state is S.READY
        for r in records
        if r.state not in (S.TAINTED, S.RECOVERING, S.UNINITIALIZED)
    )
