"""Group commit of ADMIT and RELEASE (pool.store.batch) on a real redis-server: concurrent calls
share pipelines, yet each keeps its own atomic script, its own result and its own error."""

from __future__ import annotations

import asyncio

import pytest

from pool.errors import AdmissionRefused, NotFound
from pool.store import RedisStore
from pool.types import BindingState
from testkit.harness import publish_ready

N = 200


async def test_concurrent_admits_and_releases_each_get_their_own_result(
    store: RedisStore,
) -> None:
    """Capacity is enforced per script even when many ADMITs travel in one pipeline: exactly
    ``capacity`` of ``N`` concurrent admissions win; every release reports its own binding."""
    await publish_ready(store, [("r0", "http://r0")], capacity=50)
    results = await asyncio.gather(
        *(store.admit(f"ro-{i}", "r0") for i in range(N)), return_exceptions=True
    )
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, AdmissionRefused)]
    assert len(admitted) == 50 and len(refused) == N - 50
    assert sorted(a.rollout_id for a in admitted) == sorted({a.rollout_id for a in admitted})
    assert (await store.replica("r0")).active == 50

    ids = [a.rollout_id for a in admitted]
    released = await asyncio.gather(
        *(store.release(rid, "r0", reason="x") for rid in ids),
        store.release("ro-unknown", "r0"),  # one bad call in the same batch
        *(store.release(rid, "r0") for rid in ids[:5]),  # already ended: False
        return_exceptions=True,
    )
    assert released[:50] == [True] * 50
    assert isinstance(released[50], NotFound)  # its own error, nobody else's
    assert released[51:] == [False] * 5
    assert (await store.replica("r0")).active == 0
    assert (await store.binding(ids[0])).state is BindingState.FINISHED


async def test_a_batch_survives_redis_forgetting_its_scripts(store: RedisStore) -> None:
    """After ``SCRIPT FLUSH`` (a restart, a failover to a node without the script cache), the
    pipelined EVALSHAs answer NOSCRIPT; each such call is retried alone, which loads it."""
    await publish_ready(store, [("r0", "http://r0")], capacity=1000)
    await store.admit("warm", "r0")
    await store.r.script_flush()
    admitted = await asyncio.gather(*(store.admit(f"ro-{i}", "r0") for i in range(40)))
    assert len(admitted) == 40
    await store.r.script_flush()
    assert all(await asyncio.gather(*(store.release(a.rollout_id, "r0") for a in admitted)))
    assert (await store.replica("r0")).active == 1  # "warm"


async def test_a_cancelled_caller_does_not_cancel_its_script(store: RedisStore) -> None:
    """A queued ADMIT whose caller is cancelled still runs (its binding exists); nothing hangs."""
    await publish_ready(store, [("r0", "http://r0")], capacity=1000)
    tasks = [asyncio.ensure_future(store.admit(f"ro-{i}", "r0")) for i in range(20)]
    await asyncio.sleep(0)
    tasks[-1].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[-1], asyncio.CancelledError)
    with pytest.raises(AdmissionRefused):  # the cancelled admission's binding was written
        await store.admit("ro-19", "r0")
    assert (await store.binding("ro-19")).state is BindingState.ACTIVE
