"""A start that misses its deadline leaves its Python stacks in the log and nothing running.

Fault injection (a real vLLM server cannot be made to hang at startup on demand): a stand-in
``vllm.entrypoints.launchers.api_server.entry`` module, first on ``PYTHONPATH``, that never
listens. Everything else is the real launcher: its argv/env, its process group, its deadline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pool.launcher import LaunchError, LocalReplica, ReplicaSpec

STUCK = '''
import time


def waiting_for_a_lock_that_never_comes():
    time.sleep(3600)


waiting_for_a_lock_that_never_comes()
'''


def _stand_in(root: Path) -> Path:
    pkg = root / "vllm" / "entrypoints" / "launchers" / "api_server"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == root:
            break
        (d / "__init__.py").write_text("")
    (pkg / "entry.py").write_text(STUCK)
    return root


async def test_missed_deadline_dumps_stacks_then_kills_the_group(tmp_path: Path) -> None:
    fake = _stand_in(tmp_path / "fake")
    spec = ReplicaSpec(
        model=tmp_path / "model",
        name="stuck",
        work_dir=tmp_path / "w",
        startup_timeout_s=2.0,
        env={"PYTHONPATH": str(fake)},
    )
    replica = LocalReplica(spec)
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        await replica.start()
    assert time.monotonic() - t0 < 15
    message = str(e.value)
    assert "not ready after 2s (health phase)" in message and "Python stacks" in message
    tail = e.value.context["log_tail"]
    assert "Fatal Python error: Aborted" in tail
    assert "waiting_for_a_lock_that_never_comes" in tail  # where it was stuck
    assert not replica.alive
    with pytest.raises(ProcessLookupError):
        os.killpg(replica.pid, 0)  # type: ignore[arg-type]  # the whole group is gone
