"""The record saver of a running update (:class:`updater.pending.RecordSaver`)."""

from __future__ import annotations

import asyncio

from pool.records import UpdateRecord, UpdateState
from updater.pending import RecordSaver


def record() -> UpdateRecord:
    return UpdateRecord(
        id="up-1",
        state=UpdateState.RUNNING,
        generation=1,
        label="g1",
        checkpoint="/g1",
        identity_digest="d",
        created_ms=0,
    )


async def test_progress_bursts_are_saved_coalesced_and_the_last_state_always() -> None:
    """Pins the O(N²) finding of bench/scale: every phase of every replica saved the whole
    record on the cycle's path. 200 reports in a burst now cost one or two saves, and what is
    stored in the end is the latest state."""
    rec = record()
    saved: list[str | None] = []

    async def save(r: UpdateRecord) -> None:
        saved.append(r.error)
        await asyncio.sleep(0.01)

    saver = RecordSaver(rec, save, interval_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i in range(200):
        rec.error = f"report {i}"
        saver.changed()
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    # saves are at least interval_s apart: one, plus one per interval the burst took (none,
    # unless the test process stalled)
    assert 1 <= len(saved) <= 1 + int((loop.time() - t0) / saver.interval_s)
    rec.error = "last"
    saver.changed()
    await saver.close()
    assert saved[-1] == "last"
    closed = len(saved)
    saver.changed()  # after close: ignored, nothing runs
    await asyncio.sleep(0.25)
    assert saved[-1] == "last" and len(saved) == closed


async def test_close_without_changes_saves_nothing() -> None:
    saved: list[UpdateRecord] = []

    async def save(r: UpdateRecord) -> None:
        saved.append(r)

    saver = RecordSaver(record(), save)
    await saver.close()
    assert saved == []
