"""The launcher's startup deadlines, against stand-in servers that misbehave on demand.

Fault injection (a real vLLM server cannot be made to hang, or to start slowly, on demand): a
stand-in ``vllm.entrypoints.launchers.api_server.entry`` module, first on ``PYTHONPATH``.
Everything else is the real launcher: its argv/env, its process group, its deadlines, its
``/health`` + completion probe over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pool.launcher import LaunchError, LocalReplica, ReplicaSpec
from pool.procgroup import StartupProgress, group_cpu_seconds, parse_cpus

# Writes one line (the start's last progress: the stall counts from it), then hangs.
HUNG = """
import time


def waiting_for_a_lock_that_never_comes():
    print("stand-in: hanging now", flush=True)
    time.sleep(3600)


waiting_for_a_lock_that_never_comes()
"""

# What the launcher itself may take after it gave up on a start (pool/launcher.py): the SIGABRT
# stack dump is waited for up to 3 s, the cleanup's stop gives 5 s of grace, then SIGKILL and up
# to 30 s for the group to go. A bound on a failing start's wall time is its deadline plus these.
CLEANUP_S = 3.0 + 5.0 + 30.0
#: one round of the launcher's start loop past a deadline: the 0.5 s poll and a /health probe
#: (at most 5 s; instant here, where nothing listens)
ROUND_S = 0.5 + 5.0

# Burns SPIN seconds of CPU time (a start starved by a busy host: slow, but working), then serves
# /health and a one-choice completion on --port. SPIN < 0: burn forever. CPU time, not wall time,
# so the same amount of work is done however busy the host is (it only takes longer).
SLOW = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

import os

print("startup affinity", sorted(os.sched_getaffinity(0)), flush=True)
SPIN = {spin}
while SPIN < 0 or time.process_time() < SPIN:
    sum(range(10_000))


class Handler(BaseHTTPRequestHandler):
    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({{}})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer({{"choices": [{{"text": "x"}}]}})


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
"""


def _stand_in(root: Path, source: str) -> dict[str, str]:
    pkg = root / "vllm" / "entrypoints" / "launchers" / "api_server"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == root:
            break
        (d / "__init__.py").write_text("")
    (pkg / "entry.py").write_text(source)
    return {"PYTHONPATH": str(root)}


def _spec(
    tmp_path: Path, source: str, cpu_bind: str | None = "0", **deadlines: float
) -> ReplicaSpec:
    return ReplicaSpec(
        model=tmp_path / "model",
        name="stand-in",
        work_dir=tmp_path / "w",
        env=_stand_in(tmp_path / "fake", source),
        cpu_bind=cpu_bind,
        **deadlines,
    )


def _gone(replica: LocalReplica) -> bool:
    assert replica.pid is not None
    try:
        os.killpg(replica.pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_hung_start_fails_after_the_stall_with_its_stacks_in_the_log(
    tmp_path: Path,
) -> None:
    """Fails by the stall rule (its message; before ``startup_max_s``, so within its bound), no
    earlier than ``startup_timeout_s``, with the stacks of where it hangs. A start that the
    launcher judged stalled before the stand-in had even reached its hang (starved of CPU for
    all of ``startup_timeout_s``: its line is not in the log) shows nothing here: again."""
    tails = []
    for attempt in range(3):
        spec = _spec(
            tmp_path / str(attempt),
            HUNG,
            startup_timeout_s=2.0,
            startup_stall_s=1.0,
            startup_max_s=10.0,
        )
        replica = LocalReplica(spec)
        t0 = time.monotonic()
        with pytest.raises(LaunchError) as e:
            await replica.start()
        elapsed = time.monotonic() - t0
        tail = e.value.context["log_tail"]
        assert not replica.alive and _gone(replica)
        if "stand-in: hanging now" not in tail:
            tails.append(tail)
            continue
        assert 2.0 <= elapsed < spec.startup_max_s + CLEANUP_S
        message = str(e.value)
        assert "no progress (CPU, run-queue wait or log output)" in message
        assert " S cpu " in message and "health phase" in message  # the process shown asleep
        assert "Fatal Python error: Aborted" in tail
        assert "waiting_for_a_lock_that_never_comes" in tail  # where it was stuck
        break
    else:
        pytest.fail(f"the stand-in never reached its hang before the deadline: {tails}")


async def test_a_slow_start_that_works_is_not_killed_at_the_timeout(tmp_path: Path) -> None:
    # not confined to one core (cpu_bind None): pinned to a core a busy host saturates, the
    # start can get no CPU at all for seconds, which the launcher rightly calls a stall
    spec = _spec(
        tmp_path,
        SLOW.format(spin=2.0),
        cpu_bind=None,
        startup_timeout_s=1.0,
        startup_stall_s=10.0,
        startup_max_s=120.0,
    )
    replica = LocalReplica(spec)
    try:
        took = await replica.start()
        assert took >= 2.0  # twice startup_timeout_s: kept alive by its CPU use
        assert replica.alive
    finally:
        await replica.stop(grace_s=1.0)
    assert _gone(replica)


async def test_a_start_that_never_ends_fails_at_startup_max(tmp_path: Path) -> None:
    """A start that keeps making progress (it burns CPU) still ends at ``startup_max_s``. The
    stall window is as long as ``startup_max_s``, so the stall rule cannot pre-empt it however
    little CPU a loaded host gives the stand-in (that CPU use counts as progress is the slow
    start's check); the bound is the deadline plus one loop round and the launcher's cleanup."""
    spec = _spec(
        tmp_path,
        SLOW.format(spin=-1),
        startup_timeout_s=0.5,
        startup_stall_s=3.0,
        startup_max_s=3.0,
    )
    replica = LocalReplica(spec)
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        await replica.start()
    assert 3.0 <= time.monotonic() - t0 < spec.startup_max_s + ROUND_S + CLEANUP_S
    assert "not ready after 3s (startup_max_s)" in str(e.value)
    assert _gone(replica)


def test_deadlines_must_be_ordered_and_cpu_is_measured(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="startup_max_s"):
        ReplicaSpec(model=tmp_path, startup_timeout_s=100, startup_max_s=50)
    mine = group_cpu_seconds(os.getpgrp())
    assert mine is not None and mine > 0  # this test process has used some CPU


def test_a_group_starved_of_cpu_is_progress_and_a_sleeping_one_is_not(tmp_path: Path) -> None:
    """Three busy processes of one group confined to one core can use at most the core's time
    (elapsed seconds), and wait twice that for it: with ``min_cpu_s`` above what the core can
    give, the CPU alone never marks progress, their wait for the core does. The same group
    stopped (SIGSTOP: not runnable, like a process blocked on a lock) marks none."""
    core = {max(os.sched_getaffinity(0))}
    busy = (  # the leader forks two more: one group of three, all on one core, all busy
        f"import os\nos.sched_setaffinity(0, {core})\nos.fork() and os.fork()\nwhile True: pass"
    )
    leader = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        window = 1.0
        # past the group's start (its imports), then one window: CPU at most ~window, wait ~2x
        while (group_cpu_seconds(leader.pid) or 0) < 0.2:
            time.sleep(0.05)
        t0 = time.monotonic()
        progress = StartupProgress(leader.pid, tmp_path / "none.log", t0, min_cpu_s=1.5 * window)
        time.sleep(window)
        progress.sample(time.monotonic())
        assert progress.last > t0, "a group waiting for its core is starved, not hung"
        os.killpg(leader.pid, signal.SIGSTOP)
        stopped = StartupProgress(leader.pid, tmp_path / "none.log", time.monotonic(), 0.05)
        time.sleep(2 * window)
        stopped.sample(time.monotonic())
        assert stopped.stalled_for(time.monotonic()) >= 2 * window
        assert " T cpu " in stopped.describe()  # every process shown stopped
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


async def test_a_start_is_confined_to_its_bind_cores_until_ready(tmp_path: Path) -> None:
    """The server imports (and MKL probes cores) inside its own cores; once ready, its threads
    get the launcher's CPUs back."""
    mine = os.sched_getaffinity(0)
    assert len(mine) >= 2, "needs a machine with 2 CPUs (ours have 2)"
    own = max(mine)
    replica = LocalReplica(_spec(tmp_path, SLOW.format(spin=0.5), cpu_bind=str(own)))
    try:
        await replica.start()
        assert replica.pid is not None
        assert f"startup affinity [{own}]" in replica.log_tail()
        assert os.sched_getaffinity(replica.pid) == mine
    finally:
        await replica.stop(grace_s=1.0)


def test_parse_cpus() -> None:
    assert parse_cpus("1") == {1} and parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert parse_cpus("auto") is None and parse_cpus("0-3|4-7") is None and parse_cpus(None) is None
