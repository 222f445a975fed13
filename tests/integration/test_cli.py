"""The ``rolloutpool`` command as a person runs it, against a real pool: ``rolloutpool up`` (a
real process: redis-server, one vLLM CPU replica, the updater, the router with an API key, on
free ports), then ``status`` and ``push`` as processes, piped and on a pseudo-terminal.

Pins: ``up`` ends with a "what now" block whose push command works as
printed; ``push`` shows every phase of the replica with seconds (lines when piped, a refreshing
table on a terminal, JSON for machines) and exits with a documented code and one error line;
``status`` authenticates when the router has API keys and shows the last update.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pool.records import UpdateRecord, UpdateState
from rolloutpool import progress
from testkit.procs import terminate
from tests.helpers import refused_port
from tests.integration.conftest import TinyModels

pytestmark = pytest.mark.integration

KEY = "client-key-for-cli-itest"
CLI = [sys.executable, "-m", "rolloutpool"]
PHASES = ("drain", "transfer", "invalidate", "validate", "resume")


@dataclass(frozen=True)
class Up:
    proc: subprocess.Popen[bytes]
    log: Path
    what_now: str
    router: str
    updater: str
    token: str
    push_command: list[str]


def _wait_for(log: Path, proc: subprocess.Popen[bytes], marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if marker in text or proc.poll() is not None:
            return text
        time.sleep(0.5)
    return log.read_text(errors="replace")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("cli")
    config = root / "pool.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workdir": str(root / "work"),
                "fresh": True,
                "replicas": 1,
                "router_port": 0,
                "updater_port": 0,
                "api_keys": [KEY],
            }
        )
    )
    log = root / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*CLI, "up", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        text = _wait_for(log, proc, "  stop ", 600)
        assert "What now:" in text, text[-3000:]
        block = text[text.index("RolloutPool is up") :]
        router = re.search(r"router\s+(http://\S+)/v1", block)
        updater = re.search(r"updater\s+(http://\S+)\s", block)
        token = re.search(r"admin token: (\S+)\)", block)
        push_line = re.search(r"^\s+push\s+(rolloutpool push .+)$", block, re.M)
        assert router and updater and token and push_line, block
        yield Up(
            proc,
            log,
            block,
            router.group(1),
            updater.group(1),
            token.group(1),
            shlex.split(push_line.group(1))[1:],
        )
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(120) == 0
        assert log.read_text().rstrip().endswith("stopped")
    finally:
        terminate(proc)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in r.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


def test_up_ends_with_what_to_do_next(up: Up) -> None:
    assert "RolloutPool is up: 1 of 1 replicas READY, serving generation 0." in up.what_now
    assert f"dashboard  {up.router}/dashboard" in up.what_now
    assert re.search(rf"see it\s+rolloutpool status --router {up.router} .*--token", up.what_now)
    assert up.push_command[0] == "push" and up.push_command[-2:] == ["--token", up.token]
    assert re.search(rf"stop\s+Ctrl-C here, or: kill -INT {up.proc.pid}", up.what_now)


def test_status_authenticates_with_the_api_key_or_the_token(up: Up) -> None:
    r = run("status", "--router", up.router, "--updater", up.updater)
    assert r.returncode == 5 and "--api-key" in one_error_line(r)
    r = run("status", "--router", f"{up.router}/v1", env={"ROLLOUTPOOL_API_KEY": KEY})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].startswith("published    generation 0 (g0)")
    row = next(x for x in r.stdout.splitlines() if x.startswith("replica-0"))
    assert row.split() == ["replica-0", "READY", "0", "g0", "0", row.split()[-1]]
    assert "last update  not shown" in r.stdout
    r = run("status", "--router", up.router, "--updater", up.updater, "--token", up.token)
    assert r.returncode == 0 and re.search(r"last update  (none yet|up-)", r.stdout)


def test_push_piped_shows_every_phase_and_status_shows_the_outcome(up: Up) -> None:
    r = run(*up.push_command, "--updater", up.updater)  # as printed by up
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", x) for x in r.stdout.splitlines()]
    began = [x.split()[1] for x in lines if x.startswith("replica-0 ") and "READY" not in x]
    assert [p for p in began if p in PHASES] == list(PHASES), lines
    for prev, nxt in itertools.pairwise(progress.PHASES):  # pause runs between drain, transfer
        assert any(re.match(rf"replica-0\s+{nxt}\s+\({prev} \d+\.\d+s\)$", x) for x in lines)
    ready = re.search(r"READY on generation (\d+) \(resume \d+\.\d+s; update window \d", r.stdout)
    assert ready, lines
    g = ready.group(1)
    assert re.search(rf"update up-\w+ succeeded: generation {g} \(g{g}\)", lines[-1])

    r = run("status", "--router", up.router, "--updater", up.updater, "--token", up.token)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].startswith(f"published    generation {g} (g{g})")
    assert re.search(rf"last update  up-\w+: generation {g} \(g{g}\) succeeded", r.stdout)
    assert re.search(r"replica-0\s+ready, update window \d", r.stdout)


def test_push_on_a_terminal_refreshes_a_table_per_replica(up: Up, tiny_models: TinyModels) -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(
        [*CLI, "push", str(tiny_models.b), "--updater", up.updater, "--token", up.token],
        stdout=terminal,
        stderr=terminal,
        stdin=subprocess.DEVNULL,
    )
    os.close(terminal)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], 300)
            assert ready, "push printed nothing for 300 s"
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: push exited
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(60) == 0, out.decode(errors="replace")[-3000:]
    finally:
        os.close(controller)
        terminate(proc)
    text = out.decode(errors="replace")
    assert "\x1b[" in text  # redrawn in place
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    header = next(x for x in plain.splitlines() if x.lstrip().startswith("replica"))
    assert header.split()[:2] == ["replica", "now"] and all(p in header for p in PHASES)
    final_row = [x for x in plain.splitlines() if x.lstrip().startswith("replica-0")][-1]
    assert final_row.split()[1] == "READY" and len(re.findall(r"\d+\.\d+s", final_row)) >= 6
    assert re.search(r"update up-\w+ succeeded: generation \d+ \(g\d+\)", plain)


def test_push_json_lines_for_machines(up: Up, tiny_models: TinyModels) -> None:
    r = run("push", str(tiny_models.a), "--progress", "jsonl", "--step", "3",
            "--updater", up.updater, "--token", up.token)  # fmt: skip
    assert r.returncode == 0, r.stderr
    records = [UpdateRecord.model_validate_json(x) for x in r.stdout.splitlines()]
    assert records[0].state is UpdateState.QUEUED and records[-1].state is UpdateState.SUCCEEDED
    assert not any(x.state.final for x in records[:-1])
    assert set(records[-1].replicas["replica-0"].phases) >= set(PHASES)
    assert "computing the validation probe" in r.stderr  # messages go to stderr


def test_errors_a_user_can_cause_print_one_line_and_a_documented_code(
    up: Up, tiny_models: TinyModels, tmp_path: Path
) -> None:
    base = ["push", str(tiny_models.a), "--updater", up.updater]
    r = run(*base, "--token", "not-the-token")
    assert r.returncode == 5 and "refused the token: 403" in one_error_line(r)
    r = run("push", str(tiny_models.a), "--updater", f"http://127.0.0.1:{refused_port()}")
    assert r.returncode == 4 and "cannot reach the updater" in one_error_line(r)
    r = run("push", str(tiny_models.wide), "--updater", up.updater, "--token", up.token)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "the updater refused the checkpoint: 422" in one_error_line(r)
    r = run(*base, "--token", up.token, "--label", "g0")
    assert r.returncode == 3 and "already names generation 0" in one_error_line(r)
    not_a_model = tmp_path / "weights-only"
    not_a_model.mkdir()
    (not_a_model / "model.safetensors").write_bytes(b"not safetensors")
    r = run("push", str(not_a_model), "--updater", up.updater, "--token", up.token)
    assert r.returncode == 3 and "no validation probe from" in one_error_line(r)
    r = run("status", "--router", f"http://127.0.0.1:{refused_port()}")
    assert r.returncode == 4 and "cannot reach the router" in one_error_line(r)


def test_status_watch_refreshes_until_ctrl_c(up: Up) -> None:
    proc = subprocess.Popen(
        [*CLI, "status", "--router", up.router, "--api-key", KEY, "--watch", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        blocks = 0
        for raw in proc.stdout:
            blocks += raw.startswith(b"--- ")
            if blocks == 3:
                break
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
        assert blocks == 3
    finally:
        terminate(proc)


def test_a_failed_update_exits_1_with_the_replica_and_reason(up: Up, tmp_path: Path) -> None:
    """Last in the module: the replica it taints is recovered by the updater meanwhile."""
    probe = tmp_path / "wrong-probe.json"
    probe.write_text(json.dumps({"prompt_token_ids": [5, 6, 7, 8], "expected_token_ids": [3, 3]}))
    r = run(*up.push_command, "--updater", up.updater, "--probe", str(probe))
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"replica-0\s+TAINTED \(validate \d+\.\d+s\): validate: ", r.stdout)
    assert re.search(r"update up-\w+ failed: replica-0: tainted: ", one_error_line(r))
