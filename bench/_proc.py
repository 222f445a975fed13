"""CPU accounting from ``/proc`` for benchmarks that share a small machine.

* :func:`tree_sched` — CPU seconds on a core and seconds spent runnable but *waiting* for one
  (on a run queue), summed over every thread of a process and all its live descendants
  (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds). A thread that exited during a window
  takes its time with it, so measure long-lived process trees.
* :class:`CpuMeter` — snapshots of named process trees plus the machine (``/proc/stat``) and
  CPU pressure (``/proc/pressure/cpu``, "some": time in which at least one runnable task waited
  for a core); :meth:`CpuMeter.window` turns two snapshots into cores used and run-queue wait
  per name, and the cores used by everything else (``other_cores``).
* :func:`all_processes` / :func:`others` — every process's CPU time, to say what *else* ran on
  the machine during a benchmark.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    head, _, rest = raw.rpartition(")")
    return [head.split("(", 1)[1], *rest.split()]


def descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                pass
    return out


def sched(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of all threads of ``pid``."""
    on = wait = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for t in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()
        except OSError:
            continue
        on += int(fields[0])
        wait += int(fields[1])
    return on / 1e9, wait / 1e9


def tree_sched(pid: int, alone: bool = False) -> tuple[float, float]:
    """:func:`sched` summed over ``pid`` and (unless ``alone``) its live descendants."""
    pairs = [sched(p) for p in ([pid] if alone else descendants(pid))]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def machine_busy_s() -> float:
    """CPU seconds, all cores together, not idle or iowait, since boot."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / CLK_TCK


def cpu_pressure_us() -> int | None:
    """``/proc/pressure/cpu`` "some" total (microseconds), None where PSI is not available."""
    try:
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
    except OSError:
        return None
    return int(line.rsplit("total=", 1)[1])


@dataclass
class Snapshot:
    t: float
    trees: dict[str, tuple[float, float]]
    busy_s: float
    pressure_us: int | None


@dataclass
class CpuMeter:
    """Named process trees to account for (``name -> pid``; may be changed between windows);
    names in ``alone`` count the process itself only (e.g. the caller, whose tree holds
    everything it started)."""

    pids: dict[str, int] = field(default_factory=dict)
    alone: set[str] = field(default_factory=set)

    def snap(self) -> Snapshot:
        return Snapshot(
            time.monotonic(),
            {name: tree_sched(pid, name in self.alone) for name, pid in self.pids.items()},
            machine_busy_s(),
            cpu_pressure_us(),
        )

    @staticmethod
    def window(a: Snapshot, b: Snapshot) -> dict[str, Any]:
        """CPU seconds, cores and run-queue wait per name between two snapshots (a name
        missing from ``a`` counts from zero), and the machine's busy cores and CPU pressure."""
        wall = b.t - a.t
        cpu = {n: round(v[0] - a.trees.get(n, (0.0, 0.0))[0], 4) for n, v in b.trees.items()}
        wait = {n: round(v[1] - a.trees.get(n, (0.0, 0.0))[1], 4) for n, v in b.trees.items()}
        out: dict[str, Any] = {
            "wall_s": round(wall, 3),
            "cpu_s": cpu,
            "cores": {n: round(v / wall, 3) for n, v in cpu.items()},
            "runqueue_wait_s": wait,
            "machine_busy_cores": round((b.busy_s - a.busy_s) / wall, 3),
        }
        out["other_cores"] = round(
            max(0.0, out["machine_busy_cores"] - sum(out["cores"].values())), 3
        )
        if a.pressure_us is not None and b.pressure_us is not None:
            out["cpu_pressure_some_share"] = round((b.pressure_us - a.pressure_us) / 1e6 / wall, 3)
        return out


def all_processes() -> dict[int, tuple[str, float]]:
    """``pid -> (command name, CPU seconds)`` of every process now."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None:
                out[int(entry)] = (f[0], (int(f[12]) + int(f[13])) / CLK_TCK)
    return out


def others(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    ours: set[int],
    top: int = 8,
) -> dict[str, Any]:
    """CPU seconds of processes that are not ``ours`` between two :func:`all_processes`."""
    used = [
        (name, round(cpu - before[pid][1], 2), pid)
        for pid, (name, cpu) in after.items()
        if pid in before and pid not in ours and cpu - before[pid][1] > 0
    ]
    used.sort(key=lambda x: -x[1])
    return {
        "cpu_s_total": round(sum(u[1] for u in used), 2),
        "top": [{"comm": n, "pid": p, "cpu_s": c} for n, c, p in used[:top]],
        "note": "processes alive at both ends of the run that this benchmark did not start",
    }
