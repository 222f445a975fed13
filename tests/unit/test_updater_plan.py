"""The rolling plan (updater/plan.py): pure functions over store records."""

from __future__ import annotations

from pool.types import ReplicaRecord, ReplicaState
from updater import plan

S = ReplicaState


def rec(rid: str, state: S = S.READY, generation: int | None = 1, active: int = 0) -> ReplicaRecord:
    return ReplicaRecord(
        replica_id=rid, url=f"http://{rid}", state=state, generation=generation, active=active
    )


def test_shortest_drain_first_then_replica_id() -> None:
    records = [rec("c", active=3), rec("a", active=1), rec("b", active=1), rec("d", active=0)]
    assert plan.next_batch(records, 2, 1, max_unavailable=4, min_serving=0) == ["d", "a", "b", "c"]


def test_max_unavailable_counts_replicas_already_out() -> None:
    records = [rec("a", S.DRAINING), rec("b"), rec("c"), rec("d")]
    assert plan.next_batch(records, 2, 1, max_unavailable=2, min_serving=0) == ["b"]
    records = [rec("a", S.UPDATING), rec("b", S.VALIDATING), rec("c")]
    assert plan.next_batch(records, 2, 1, max_unavailable=2, min_serving=0) == []


def test_min_serving_is_kept() -> None:
    records = [rec("a"), rec("b"), rec("c"), rec("d")]
    assert plan.next_batch(records, 2, 1, max_unavailable=4, min_serving=2) == ["a", "b"]
    assert plan.next_batch(records, 2, 1, max_unavailable=4, min_serving=3) == ["a"]
    out = [rec("a", S.DRAINING), rec("b"), rec("c"), rec("d")]
    assert plan.next_batch(out, 2, 1, max_unavailable=4, min_serving=3) == []


def test_unreachable_min_serving_degrades_to_one_at_a_time() -> None:
    assert plan.next_batch([rec("a")], 2, 1, max_unavailable=1, min_serving=1) == ["a"]
    records = [rec("a"), rec("b"), rec("c")]
    assert plan.next_batch(records, 2, 1, max_unavailable=3, min_serving=3) == ["a"]


def test_only_ready_replicas_not_on_the_target_and_not_excluded() -> None:
    records = [
        rec("a", generation=2),
        rec("b", S.TAINTED),
        rec("c", S.RECOVERING),
        rec("d"),
        rec("e"),
    ]
    assert plan.next_batch(records, 2, 2, max_unavailable=5, min_serving=0, exclude={"d"}) == ["e"]


def test_replicas_already_on_the_target_count_as_serving() -> None:
    # after the first replica published g2, the old ones on g1 no longer admit (staleness 0)
    records = [rec("a", generation=2), rec("b"), rec("c")]
    assert plan.next_batch(records, 2, 2, max_unavailable=3, min_serving=1) == ["b", "c"]
    assert plan.next_batch(records, 2, 2, max_unavailable=3, min_serving=2) == []
    # with max_staleness 1 the g1 replicas still admit and count
    assert plan.next_batch(records, 2, 2, max_unavailable=3, min_serving=2, max_staleness=1) == [
        "b"
    ]


def test_done_ignores_replicas_that_recovery_owns() -> None:
    assert plan.done([rec("a", generation=2), rec("b", S.TAINTED)], 2)
    assert plan.done([rec("a", generation=2), rec("b", S.UNINITIALIZED, None)], 2)
    assert not plan.done([rec("a", generation=2), rec("b")], 2)
    assert not plan.done([rec("a", S.VALIDATING, generation=2)], 2)


def test_admitting_respects_staleness() -> None:
    records = [rec("a", generation=3), rec("b", generation=2), rec("c", S.DRAINING, 3)]
    assert plan.admitting(records, 3, 0) == ["a"]
    assert plan.admitting(records, 3, 1) == ["a", "b"]
