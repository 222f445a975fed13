"""Following one update as ``rolloutpool push`` waits: what changed between two snapshots of its
record, shown four ways.

The updater saves an update's record each time a replica's phase begins (``phase``) and each
time a cycle ends (``phases`` gains the seconds of every phase that ended), so successive
snapshots of ``GET /v1/updates/{id}`` show the update live. :class:`Tracker` turns snapshots into
events; it is pure (the caller passes the time) and tolerates missed snapshots: a phase that
began and ended between two polls is still reported, in the order the cycle ran it.

Views (one per ``--progress`` mode), each fed every snapshot with :meth:`View.show` and closed
once with :meth:`View.close`; none of them raises on a snapshot it has seen before:

* :class:`Lines` — one plain line per event (``[12:00:01] replica-0  transfer  (pause 0.00s)``):
  for pipes and logs;
* :class:`LiveTable` — a per-replica table refreshed in place (rich): for a terminal;
* :class:`JsonLines` — the whole record as one JSON line each time it changes, except the final
  one (the caller prints that): for machines;
* :class:`Silent` — nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pool.records import ReplicaOutcome, ReplicaReport, UpdateRecord, UpdateState

#: The phases of an update cycle in the order they run (``updater.cycle``); a phase the updater
#: reports that is not listed here is shown after them.
PHASES = (
    "preflight",
    "drain",
    "pause",
    "routers",  # every router verified the Redis failover epoch (updater.failover)
    "transfer",
    "invalidate",
    "validate",
    "resume",
)


def seconds(s: float) -> str:
    """``0.91s``, ``12.3s``, ``241s``."""
    if s < 10:
        return f"{s:.2f}s"
    return f"{s:.1f}s" if s < 100 else f"{s:.0f}s"


# ---------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class StateChanged:
    """The update's state changed (``queued`` and ``running`` before its replicas' events; a
    final state after them)."""

    record: UpdateRecord


@dataclass(frozen=True)
class PhaseBegan:
    """``replica`` began ``phase``; ``previous`` (if any) ended after ``previous_s`` seconds."""

    replica: str
    phase: str
    previous: str | None
    previous_s: float | None


@dataclass(frozen=True)
class ReplicaEnded:
    """A replica's cycle ended (``report.outcome``); ``last`` is the phase it ended in."""

    report: ReplicaReport
    last: str | None
    last_s: float | None


Event = StateChanged | PhaseBegan | ReplicaEnded


class Tracker:
    """Events between successive snapshots of one update record. Not thread-safe."""

    def __init__(self) -> None:
        self._state: UpdateState | None = None
        self._seen: dict[str, list[str]] = {}  # replica -> phases reported, in order
        self._ended: set[str] = set()
        self._since: dict[str, tuple[str, float]] = {}  # replica -> (current phase, first seen)

    def feed(self, rec: UpdateRecord, now: float) -> list[Event]:
        """The events since the last snapshot (``now``: a monotonic time, for :meth:`running`)."""
        events: list[Event] = []
        changed = rec.state is not self._state
        self._state = rec.state
        if changed and not rec.state.final:
            events.append(StateChanged(rec))
        for rid, report in rec.replicas.items():
            events.extend(self._replica(rid, report, now))
        if changed and rec.state.final:
            events.append(StateChanged(rec))
        return events

    def _replica(self, rid: str, report: ReplicaReport, now: float) -> list[Event]:
        seen = self._seen.setdefault(rid, [])
        order = list(report.phases)
        if report.phase is not None and report.phase not in report.phases:
            order.append(report.phase)
        events: list[Event] = []
        for name in order[len(seen) :]:
            prev = seen[-1] if seen else None
            events.append(PhaseBegan(rid, name, prev, report.phases.get(prev or "")))
            seen.append(name)
        if report.phase is not None and self._since.get(rid, ("",))[0] != report.phase:
            self._since[rid] = (report.phase, now)
        if report.outcome is not ReplicaOutcome.RUNNING and rid not in self._ended:
            self._ended.add(rid)
            self._since.pop(rid, None)
            last = seen[-1] if seen else None
            events.append(ReplicaEnded(report, last, report.phases.get(last or "")))
        return events

    def running(self, rid: str, now: float) -> float | None:
        """Seconds ``rid``'s current phase has run, as observed here (None: no phase running)."""
        since = self._since.get(rid)
        return None if since is None else now - since[1]


def line(event: Event) -> str:
    """One plain line for ``event`` (no time stamp)."""
    if isinstance(event, PhaseBegan):
        text = f"{event.replica:<12} {event.phase:<10}"
        if event.previous is not None and event.previous_s is not None:
            text += f" ({event.previous} {seconds(event.previous_s)})"
        return text.rstrip()
    if isinstance(event, ReplicaEnded):
        r = event.report
        text = f"{r.replica:<12} {r.outcome.value.upper()}"
        if r.outcome is ReplicaOutcome.READY:
            text += f" on generation {r.generation}"
        details = []
        if event.last is not None and event.last_s is not None:
            details.append(f"{event.last} {seconds(event.last_s)}")
        if r.window_s is not None:
            details.append(f"update window {seconds(r.window_s)}")
        if details:
            text += f" ({'; '.join(details)})"
        return text + (f": {r.reason.strip()}" if r.reason.strip() else "")
    return summary(event.record)


def summary(rec: UpdateRecord) -> str:
    """The update's state in one line."""
    head = f"update {rec.id}"
    target = f"generation {rec.generation} ({rec.label})"
    if rec.state is UpdateState.QUEUED:
        return f"{head} queued: {target}"
    if rec.state is UpdateState.RUNNING:
        return f"{head} running: {target}"
    if rec.state is UpdateState.SUCCEEDED:
        text = f"{head} succeeded: {target} is served by every replica in service"
        if rec.staleness_window_s is not None:
            text += f" (staleness window {seconds(rec.staleness_window_s)})"
        return text
    return f"{head} {rec.state.value}: {rec.error.strip() or 'no reason recorded'}"


# ---------------------------------------------------------------------------------- views


class View(Protocol):
    def show(self, rec: UpdateRecord) -> None: ...

    def close(self) -> None: ...


class Silent:
    def show(self, rec: UpdateRecord) -> None:
        pass

    def close(self) -> None:
        pass


class Lines:
    """One line per event on ``out``, each stamped with the local time it was seen."""

    def __init__(self, out: TextIO, clock: Callable[[], str] | None = None) -> None:
        self.out = out
        self.clock = clock or (lambda: time.strftime("%H:%M:%S"))
        self.tracker = Tracker()

    def show(self, rec: UpdateRecord) -> None:
        for event in self.tracker.feed(rec, time.monotonic()):
            print(f"[{self.clock()}] {line(event)}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class JsonLines:
    """Each changed, not yet final record as one JSON line on ``out``."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._last = ""

    def show(self, rec: UpdateRecord) -> None:
        text = dumps(rec)
        if text != self._last and not rec.state.final:
            print(text, file=self.out, flush=True)
        self._last = text

    def close(self) -> None:
        pass


def _cell(report: ReplicaReport | None, phase: str, running: float | None) -> Text:
    if report is None:
        return Text("")
    if phase in report.phases:
        return Text(seconds(report.phases[phase]))
    if report.phase == phase:
        return Text(f"{seconds(running or 0.0)}…", style="bold yellow")
    return Text("")


def _now(report: ReplicaReport | None) -> Text:
    if report is None:
        return Text("waiting", style="dim")
    if report.outcome is ReplicaOutcome.RUNNING:
        return Text(report.phase or "…", style="bold yellow")
    style = "bold green" if report.outcome is ReplicaOutcome.READY else "bold red"
    return Text(f"{report.outcome.value.upper()}", style=style)


#: Phases the live table leaves out when the terminal is too narrow for every column: they take
#: milliseconds, and the "now" column still names them while they run.
BRIEF = ("preflight", "pause", "routers")


def _table(
    rec: UpdateRecord,
    rows: Sequence[str],
    columns: Sequence[str],
    running: Callable[[str], float | None],
    elapsed_s: float,
) -> Table:
    t = Table(title_justify="left", box=None, pad_edge=False, collapse_padding=True)
    t.title = (
        f"update {rec.id} → generation {rec.generation} ({rec.label})  "
        f"{rec.state.value}  {seconds(elapsed_s)}"
    )
    t.add_column("replica", no_wrap=True)
    t.add_column("now", no_wrap=True)
    for p in columns:
        t.add_column(p, justify="right", no_wrap=True)
    t.add_column("window", justify="right", no_wrap=True)
    for rid in rows:
        report = rec.replicas.get(rid)
        window = "" if report is None or report.window_s is None else seconds(report.window_s)
        t.add_row(rid, _now(report), *(_cell(report, p, running(rid)) for p in columns), window)
    return t


def table(
    rec: UpdateRecord,
    replicas: Sequence[str],
    running: Callable[[str], float | None],
    elapsed_s: float,
    width: int | None = None,
) -> Group:
    """The live view of ``rec``: a title, one row per replica (``replicas`` first, in that
    order, then any other the record names), one column per phase (without :data:`BRIEF` if
    the table would be wider than ``width``), the reasons and the final outcome below.
    ``running(rid)`` gives the seconds the replica's current phase has run."""
    rows = list(dict.fromkeys([*replicas, *rec.replicas]))
    reported = [p for r in rec.replicas.values() for p in [*r.phases, r.phase or ""] if p]
    columns = list(dict.fromkeys([*PHASES, *reported]))
    t = _table(rec, rows, columns, running, elapsed_s)
    if width is not None and Console(width=1 << 12).measure(t).maximum > width:
        t = _table(rec, rows, [p for p in columns if p not in BRIEF], running, elapsed_s)
    notes = [
        Text(f"{r.replica}: {r.reason}", style="red")
        for r in rec.replicas.values()
        if r.reason and r.outcome is not ReplicaOutcome.READY
    ]
    if rec.state.final:
        notes.append(Text(summary(rec)))
    return Group(t, *notes)


class LiveTable:
    """:func:`table` refreshed in place on ``console`` (rich ``Live``); the last view stays."""

    def __init__(self, console: Console, replicas: Sequence[str] = ()) -> None:
        self.console = console
        self.replicas = list(replicas)
        self.tracker = Tracker()
        self.t0 = time.monotonic()
        self.live = Live(console=console, auto_refresh=False, transient=False)
        self.live.start()

    def show(self, rec: UpdateRecord) -> None:
        now = time.monotonic()
        self.tracker.feed(rec, now)
        view = table(
            rec,
            self.replicas,
            lambda rid: self.tracker.running(rid, now),
            now - self.t0,
            self.console.width,
        )
        self.live.update(view, refresh=True)

    def close(self) -> None:
        self.live.stop()


def dumps(rec: UpdateRecord) -> str:
    """The record as one line of JSON (what ``--json`` prints, and each line of JSON progress)."""
    return rec.model_dump_json()


__all__ = [
    "BRIEF",
    "PHASES",
    "Event",
    "JsonLines",
    "Lines",
    "LiveTable",
    "PhaseBegan",
    "ReplicaEnded",
    "Silent",
    "StateChanged",
    "Tracker",
    "View",
    "dumps",
    "line",
    "seconds",
    "summary",
    "table",
]
