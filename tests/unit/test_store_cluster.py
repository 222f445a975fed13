"""The store's unit tests against a real 3-primary Redis Cluster (``redis-server
--cluster-enabled yes`` x3 + ``redis-cli --cluster create``, started here).

Every key of a pool carries the hash tag ``{<namespace>}``, so each Lua script's KEYS and each
pipeline stay in one slot; these tests fail if a script or pipeline touched a key outside it
(redis-py raises CROSSSLOT / "keys in request don't hash to the same slot"). The tests are the
very functions of :mod:`tests.unit.test_store` (imported, so collected here with this module's
``store_settings``) and the stateful machine of :mod:`tests.unit.test_lifecycle_stateful`.
Left out: tests that start their own standalone server or pin the standalone connection pool
(a cluster client has one non-blocking pool per node).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from pool.settings import StoreSettings
from pool.store import RedisStore
from testkit.redis_ha import ClusterGroup
from tests.unit.test_lifecycle_stateful import PoolMachine
from tests.unit.test_store import (  # noqa: F401 (collected here against the cluster)
    test_admission_refusals_name_their_reason,
    test_admit_release_and_provenance,
    test_declare_generation_is_write_once_and_monotonic,
    test_fencing_rejects_a_stale_updater,
    test_memory_is_bounded_by_design,
    test_no_admission_lands_after_the_drain_cas,
    test_quiesce_and_update_refused_with_active_bindings,
    test_reaper_aborts_orphans_once,
    test_reaper_leaves_a_binding_renewed_after_its_scan,
    test_second_updater_waits_on_the_lease,
    test_staleness_after_publish,
    test_taint_needs_no_lease_and_closes_admissions,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterGroup]:
    group = ClusterGroup(Path(tmp_path_factory.mktemp("cluster"))).start()
    yield group
    group.stop()


@pytest.fixture
def store_settings(cluster: ClusterGroup) -> StoreSettings:
    return StoreSettings(url=cluster.url, cluster=True, namespace=f"t{uuid.uuid4().hex[:12]}")


async def test_the_pool_lives_in_one_slot_of_a_three_primary_cluster(
    store: RedisStore, cluster: ClusterGroup
) -> None:
    """Pins the premise: three primaries share the slots, and every key the pool wrote hashes
    to the one slot of its namespace's tag."""
    token = await store.updater_lease().acquire()
    await store.register_replica("r0", "http://r0", token)
    nodes = await store.r.cluster_nodes()
    assert sum(1 for n in nodes.values() if "master" in n["flags"]) == 3
    keys = [k async for k in store.r.scan_iter(match=f"{store.k.p}*")]
    assert len(keys) >= 4
    assert len({store.r.keyslot(k) for k in keys}) == 1


def test_pool_invariants_hold_on_a_cluster(cluster: ClusterGroup) -> None:
    where = StoreSettings(url=cluster.url, cluster=True)
    run_state_machine_as_test(
        lambda: PoolMachine(where),
        settings=settings(
            max_examples=5,  # every rule (so every script) runs; the breadth is standalone's
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
