"""How ``rolloutpool push`` shows an update's progress, from update records recorded off a real
pool (two vLLM CPU replicas, ``rolloutpool push --progress jsonl``): a rolling update that
succeeded, and one whose first replica failed validation (a deliberately wrong probe).

The CLI polls every 0.2 s, so it misses snapshots (the recorded success skips most phases of
replica-0); the tracker still reports every phase in the order it ran, with its seconds.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from pool.records import UpdateRecord
from rolloutpool.progress import JsonLines, Lines, PhaseBegan, ReplicaEnded, Tracker, line, table

DATA = Path(__file__).parent / "data"


def recorded(name: str) -> list[UpdateRecord]:
    return [UpdateRecord.model_validate_json(x) for x in (DATA / f"{name}.jsonl").open()]


def lines(records: list[UpdateRecord]) -> list[str]:
    out = io.StringIO()
    view = Lines(out, clock=lambda: "12:00:00")
    for rec in records:
        view.show(rec)
    return out.getvalue().splitlines()


def test_a_recorded_rolling_update_gives_a_line_per_phase_change() -> None:
    assert lines(recorded("update_succeeded")) == [
        "[12:00:00] update up-c1b892d7dcd0 queued: generation 1 (g1)",
        "[12:00:00] update up-c1b892d7dcd0 running: generation 1 (g1)",
        "[12:00:00] replica-0    preflight",
        "[12:00:00] replica-0    drain      (preflight 0.00s)",
        "[12:00:00] replica-0    pause      (drain 0.00s)",
        "[12:00:00] replica-0    transfer   (pause 0.05s)",
        "[12:00:00] replica-0    invalidate (transfer 0.03s)",
        "[12:00:00] replica-0    validate   (invalidate 0.01s)",
        "[12:00:00] replica-0    resume     (validate 0.04s)",
        "[12:00:00] replica-0    READY on generation 1 (resume 0.00s; update window 0.08s)",
        "[12:00:00] replica-1    preflight",
        "[12:00:00] replica-1    drain      (preflight 0.00s)",
        "[12:00:00] replica-1    pause      (drain 0.00s)",
        "[12:00:00] replica-1    transfer   (pause 0.16s)",
        "[12:00:00] replica-1    invalidate (transfer 0.14s)",
        "[12:00:00] replica-1    validate   (invalidate 0.04s)",
        "[12:00:00] replica-1    resume     (validate 0.06s)",
        "[12:00:00] replica-1    READY on generation 1 (resume 0.01s; update window 0.27s)",
        "[12:00:00] update up-c1b892d7dcd0 succeeded: generation 1 (g1) is served by every "
        "replica in service (staleness window 0.57s)",
    ]


def test_a_recorded_failed_validation_names_the_replica_phase_and_reason() -> None:
    out = lines(recorded("update_failed"))
    reason = (
        "validate: PostconditionFailed: ValidationEvidence does not prove the postcondition in "
        "VALIDATING: label_ok=True probe_matches=False"
    )
    assert out[-2:] == [
        f"[12:00:00] replica-0    TAINTED (validate 0.03s): {reason}",
        f"[12:00:00] update up-e42a015b82aa failed: replica-0: tainted: {reason}",
    ]
    assert [x.split()[2] for x in out[2:-2]] == [
        "preflight", "drain", "pause", "transfer", "invalidate", "validate"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["update_succeeded", "update_failed"])
@pytest.mark.parametrize("keep", ["all", "first_and_last", "last", "twice"])
def test_missed_or_repeated_snapshots_report_the_same_phases(name: str, keep: str) -> None:
    records = recorded(name)
    chosen = {
        "all": records,
        "first_and_last": [records[0], records[-1]],
        "last": records[-1:],
        "twice": [r for r in records for _ in (1, 2)],
    }[keep]
    tracker = Tracker()
    events = [e for r in chosen for e in tracker.feed(r, 0.0)]
    replica_lines = [line(e) for e in events if isinstance(e, PhaseBegan | ReplicaEnded)]
    expected = [x.removeprefix("[12:00:00] ") for x in lines(records)]
    assert replica_lines == [x for x in expected if x.startswith("replica-")]


def test_the_live_table_shows_each_replica_and_the_phase_it_is_in() -> None:
    mid = recorded("update_succeeded")[3]  # replica-0 READY, replica-1 validating
    console = Console(record=True, width=120, color_system=None)
    console.print(table(mid, ["replica-0", "replica-1", "replica-2"], lambda rid: 1.5, 0.4, 120))
    text = console.export_text()
    rows = {x.split()[0]: x.split()[1:] for x in text.splitlines()[2:5]}
    assert rows["replica-0"] == ["READY", "0.00s", "0.00s", "0.05s", "0.03s", "0.01s", "0.04s",
                                 "0.00s", "0.08s"]  # fmt: skip
    assert rows["replica-1"] == ["validate", "0.00s", "0.00s", "0.16s", "0.14s", "0.04s", "1.50s…"]
    assert rows["replica-2"] == ["waiting"]
    assert text.splitlines()[0].startswith("update up-c1b892d7dcd0 → generation 1 (g1)  running")


def test_json_lines_print_each_changed_record_until_the_final_one() -> None:
    records = recorded("update_succeeded")
    out = io.StringIO()
    view = JsonLines(out)
    for rec in [r for r in records for _ in (1, 2)]:
        view.show(rec)
    printed = [UpdateRecord.model_validate_json(x) for x in out.getvalue().splitlines()]
    assert printed == records[:-1]  # the caller prints the final record
