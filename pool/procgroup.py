"""A local server's process group as ``/proc`` shows it: CPU cores a start is confined to
(:func:`parse_cpus`, :func:`widen_affinity`), the CPU it used and the time it waited for a CPU
(:func:`group_cpu_seconds`, :func:`group_run_wait_seconds`) and whether a start is still making
progress (:class:`StartupProgress`). Linux only where it says so; elsewhere the reads answer
``None`` and the affinity calls change nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "StartupProgress",
    "group_cpu_seconds",
    "group_run_wait_seconds",
    "group_stats",
    "parse_cpus",
    "thread_affinity",
    "widen_affinity",
]


def parse_cpus(spec: str | None) -> set[int] | None:
    """``"1"``, ``"0-3"``, ``"0,2"`` → CPU ids; ``None`` for anything else (``"auto"``, vLLM's
    per-rank ``"0-3|4-7"``, ``"nobind"``)."""
    if not spec:
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return cpus or None


def group_stats(pgid: int) -> dict[int, list[str]]:
    """``/proc/<pid>/stat`` fields after ``pid (comm)`` (state first) of each live process of
    group ``pgid``; empty where ``/proc`` is unavailable."""
    out: dict[int, list[str]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # pgrp
            out[int(entry.name)] = fields
    return out


@contextlib.contextmanager
def thread_affinity(cpus: set[int] | None) -> Iterator[None]:
    """Run the block with the calling thread (only) confined to ``cpus`` (None: unchanged)."""
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def widen_affinity(pgid: int, cpus: set[int], skip_comm_prefix: str = "VLLM::Worker") -> int:
    """Set every thread of group ``pgid`` to ``cpus``, except processes whose name starts with
    ``skip_comm_prefix`` (vLLM binds its CPU worker's threads itself). Returns threads changed.
    Linux only (a no-op elsewhere); threads that exit meanwhile are ignored."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    changed = 0
    for pid in group_stats(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith(skip_comm_prefix):
                continue
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)
                changed += 1
    return changed


def group_cpu_seconds(pgid: int) -> float | None:
    """CPU seconds used by the live processes of process group ``pgid`` (plus the children they
    have reaped), from ``/proc``; ``None`` where ``/proc`` is not available (not Linux)."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = sum(  # utime, stime, cutime, cstime
        sum(int(f) for f in fields[11:15]) for fields in group_stats(pgid).values()
    )
    return ticks / os.sysconf("SC_CLK_TCK")


def group_run_wait_seconds(pgid: int) -> float | None:
    """Seconds the live threads of process group ``pgid`` spent runnable but waiting for a CPU
    (``/proc/<pid>/task/<tid>/schedstat``, the run-queue delay); ``None`` without schedstats."""
    if not Path("/proc/self/schedstat").exists():
        return None
    ns = 0
    for pid in group_stats(pgid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ns += int((task / "schedstat").read_text().split()[1])
    return ns / 1e9


class StartupProgress:
    """Whether a starting process group is still doing something.

    :meth:`sample` marks progress when, since the last mark, the group used at least
    ``min_cpu_s`` of CPU, or waited that long for a CPU while runnable, or the log grew. A
    start slowed by a saturated host still uses CPU (imports, then the engine's own start), and
    one starved outright (a thread queued on a core that another replica's pinned worker
    saturates) is still runnable; a hung one (a lock, a peer that never answers) sleeps, and
    does neither. Without ``/proc`` only the log counts. Not thread-safe; cheap (one ``/proc``
    scan).
    """

    def __init__(self, pgid: int, log_path: Path, now: float, min_cpu_s: float = 0.5) -> None:
        self.pgid = pgid
        self.log_path = log_path
        self.min_cpu_s = min_cpu_s
        self.last = now
        self._cpu = group_cpu_seconds(pgid)
        self._wait = group_run_wait_seconds(pgid)
        self._log = self._log_size()

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def sample(self, now: float) -> None:
        cpu, wait = group_cpu_seconds(self.pgid), group_run_wait_seconds(self.pgid)
        size = self._log_size()
        moved = size > self._log or _grew(cpu, self._cpu, self.min_cpu_s)
        moved = moved or _grew(wait, self._wait, self.min_cpu_s)
        if moved:
            self.last, self._cpu, self._wait, self._log = now, cpu, wait, size
            return
        # a process exited with its time: re-base, so its loss does not hide the others' gain
        if cpu is not None and self._cpu is not None and cpu < self._cpu:
            self._cpu = cpu
        if wait is not None and self._wait is not None and wait < self._wait:
            self._wait = wait

    def stalled_for(self, now: float) -> float:
        return now - self.last

    def describe(self) -> str:
        """Each process of the group now: pid, name, state (R runnable, S sleeping, D in I/O
        ...) and CPU seconds; what a failed start was doing when it was given up on."""
        tick = os.sysconf("SC_CLK_TCK")
        parts = []
        for pid, fields in sorted(group_stats(self.pgid).items()):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = "?"
            cpu = sum(int(f) for f in fields[11:13]) / tick
            parts.append(f"{pid} {comm} {fields[0]} cpu {cpu:.1f}s")
        return "; ".join(parts) or "no process left"


def _grew(now: float | None, before: float | None, by: float) -> bool:
    return now is not None and before is not None and now - before >= by
