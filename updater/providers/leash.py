"""A leash: kill a process group once the process that owns it is gone.

``python -m updater.providers.leash OWNER_PID OWNER_START PGID`` polls every ``--every`` seconds
and SIGKILLs process group ``PGID`` as soon as process ``OWNER_PID`` (whose start time, in clock
ticks since boot, was ``OWNER_START``) no longer exists; it exits once the group is gone. The
start time makes a recycled pid count as gone. With ``--detach`` it forks, prints the watching
process's pid and returns: the watcher is then nobody's child but init's (or a subreaper's).

Why: a Ray actor runs its replica's vLLM server as a process group of its own session. When the
actor dies (``ray.kill``, a crash, its node's raylet going down) nothing signals that group.
Ray kills a dying worker's *direct* children (``RAY_kill_child_processes_on_worker_exit``, on
by default): the server's API process, but not its EngineCore and worker processes, which then
keep running, holding CPUs or a GPU, with no owner (seen in the Ray provider's test). Ray reaps
the whole tree only on clusters started with
``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper=1``. The leash needs no cluster
setting. It is detached (not a direct child of its owner, so that clean-up does not end it
first) and runs in a session of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Leash", "attach", "main", "runs", "start_ticks"]


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22);
    None if it is gone or there is no ``/proc``."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[19])


def runs(pid: int, started: int) -> bool:
    """Whether process ``pid``, started at ``started`` ticks (:func:`start_ticks`), still runs:
    not gone, not a recycled pid, not a zombie waiting for its parent to reap it."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    tail = raw[raw.rindex(")") + 2 :]
    return tail[0] != "Z" and int(tail.split()[19]) == started


@dataclass(frozen=True)
class Leash:
    """A running leash: its pid and start time (so :meth:`cut` never signals a recycled pid)."""

    pid: int
    started: int | None

    def cut(self) -> None:
        """Stop the leash (its group is ended by the caller); no-op if it is gone."""
        if self.started is not None and start_ticks(self.pid) == self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def attach(pgid: int, owner: int | None = None, every_s: float = 0.5) -> Leash:
    """Start a detached leash on group ``pgid`` for ``owner`` (default: this process)."""
    owner = os.getpid() if owner is None else owner
    started = start_ticks(owner)
    if started is None:
        raise RuntimeError(f"no start time for process {owner} (no /proc?): cannot leash")
    argv = [sys.executable, "-m", "updater.providers.leash", str(owner), str(started), str(pgid)]
    out = subprocess.run(
        [*argv, "--every", str(every_s), "--detach"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        start_new_session=True,
    )
    pid = int(out.stdout.strip())
    return Leash(pid, start_ticks(pid))


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m updater.providers.leash")
    ap.add_argument("owner", type=int)
    ap.add_argument("owner_start", type=int)
    ap.add_argument("pgid", type=int)
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--detach", action="store_true")
    args = ap.parse_args(argv)
    if args.detach:
        child = os.fork()
        if child:
            print(child, flush=True)
            os._exit(0)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    while _group_exists(args.pgid):
        if start_ticks(args.owner) != args.owner_start:  # the owner is gone (or a new pid)
            try:
                os.killpg(args.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(args.every)


if __name__ == "__main__":
    main()
