"""The ``rolloutpool`` command against a real router and a real updater API (real Redis, no vLLM).

The updater is the real service object and HTTP API, not started: its one replica is an
unreachable URL, so no worker runs. ``push`` gets its probe from ``--probe`` (no torch here), the
updater's real ``submit`` queues the update, and the test plays the update worker: it takes the
update and moves its record to the state under test. The whole path (HTTP, auth, the updater's
refusals, the CLI's following, output and exit code) is the real one. Against a real vLLM pool:
tests/integration/test_cli.py.

Pins: ``status`` read ``latest.number`` (the published generation is ``latest.generation``) and
sent no API key; ``push`` printed tracebacks for a wrong token or an unreachable updater.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import pytest
from aiohttp import web
from click.testing import CliRunner, Result
from safetensors.numpy import save_file

from pool.checkpoint import read_manifest
from pool.records import ReplicaOutcome, ReplicaReport, UpdateRecord, UpdateState
from pool.settings import StoreSettings
from pool.store import RedisStore
from pool.types import GenerationRecord, WeightIdentity
from pool.web import start_server
from rolloutpool import progress, status
from rolloutpool.cli import cli
from rolloutpool.errors import ExitCode
from router.settings import RouterSettings
from testkit.harness import G0, RunningRouter, publish_ready, serve_router
from tests.helpers import refused_port
from updater.app import create_api
from updater.service import Updater
from updater.settings import ReplicaConfig, UpdaterSettings

TOKEN = "admin-token-for-cli-tests"
KEY = "client-key-for-cli-tests"
QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "guides" / "quickstart.md"


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def one_error_line(result: Result) -> str:
    """The single ``Error: ...`` line a failing command writes on stderr (and no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------- help


def test_top_level_help_says_what_the_pool_is_and_what_to_run_first() -> None:
    r = invoke(["--help"])
    assert r.exit_code == 0
    what, first = r.stdout.split("\n\n")[1].strip().splitlines()
    assert "vLLM replicas" in what and "hot-updated" in what
    assert "'rolloutpool up'" in first
    assert "``" not in r.stdout  # no reStructuredText in a terminal
    assert set(cli.commands) == {"up", "status", "push", "demo"}


@pytest.mark.parametrize("name", ["up", "status", "push", "demo"])
def test_every_option_has_a_help_line_a_default_and_an_environment_variable(name: str) -> None:
    command = cli.commands[name]
    ctx = click.Context(command, info_name=name)
    options = [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]
    assert options
    for option in options:
        record = option.get_help_record(ctx)
        assert record is not None, option.name
        help_text = record[1]
        assert "\n" not in (option.help or "") and option.help, option.name
        assert "env var: ROLLOUTPOOL_" in help_text, (option.name, help_text)
        assert "default: " in help_text, (option.name, help_text)
    assert command.epilog is not None and "Examples:" in command.epilog
    assert f"rolloutpool {name}" in command.epilog
    assert invoke([name, "--help"]).exit_code == 0


def test_exit_codes_are_listed_in_the_help_and_the_docs() -> None:
    readme = QUICKSTART.read_text()
    for name in ("push", "status"):
        text = invoke([name, "--help"]).stdout
        for code in ExitCode:
            assert re.search(rf"^\s+{code.value}\s+\S", text, re.M), (name, code)
    table = dict(re.findall(r"^\| `(\d+)` \| (.+?) \|$", readme, re.M))
    assert {int(c) for c in table} == {c.value for c in ExitCode}


def test_status_and_push_run_where_testkit_is_not_installed() -> None:
    """The deploy image has pool, router, updater and rolloutpool, not testkit (which only the
    embedded pool of ``up`` and ``demo`` needs). Pins: every command imported it."""
    code = (
        "import sys; sys.modules['testkit'] = None\n"
        "from rolloutpool.cli import main\n"
        "main(['status', '--router', 'http://127.0.0.1:9'])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == ExitCode.UNREACHABLE, r.stderr
    assert r.stderr.startswith("Error: cannot reach the router at http://127.0.0.1:9")


# ------------------------------------------------------------------------ up: config errors

#: (pool.yaml, what the one error line must say): every mistake ends ``up`` before anything
#: starts, with exit 2, the file, the key and where it belongs.
CONFIG_MISTAKES = {
    "a key inside the wrong section (the pool sets it)": (
        "router: {api_keys: [k1]}",
        "router.api_keys belongs at the top level, as api_keys, not under router:",
    ),
    "a port under its service": (
        "updater: {port: 9301}",
        "updater.port belongs at the top level, as updater_port, not under updater:",
    ),
    "a section's key at the top level": (
        "session_lease_s: 5",
        "unknown key session_lease_s: it belongs under router:",
    ),
    "a key under another section": (
        "router: {drain_timeout_s: 5}",
        "unknown key router.drain_timeout_s: it belongs under updater:",
    ),
    "a misspelt key": ("replicass: 3", "unknown key replicass (did you mean replicas"),
    "a misspelt section key": (
        "redis: {sentinals: [h:1]}",
        "unknown key redis.sentinals (did you mean sentinels",
    ),
    "an unknown key": ("colour: blue", "unknown key colour; the keys there are admin_token,"),
    "an unknown nested key": (
        "ray: {adress: h:1}",
        "unknown key ray.adress (did you mean address?)",
    ),
    "a key given twice": (
        "replicas: 1\nfresh: true\nreplicas: 2",
        "replicas is given twice (lines 1 and 3)",
    ),
    "a section key given twice": (
        "router:\n  max_staleness: 1\n  max_staleness: 2",
        "router.max_staleness is given twice (lines 2 and 3)",
    ),
    "a wrong type": ("replicas: two", "replicas: Input should be a valid integer"),
    "a wrong type in a section": (
        "router: {max_staleness: soon}",
        "router.max_staleness: Input should be a valid integer",
    ),
    "a wrong type of section": ("ray: 5", "ray: Input should be a valid dictionary"),
    "a bad replica value": (
        "replica: {flavor: tpu}",
        "replica.flavor: Input should be 'cpu' or 'gpu'",
    ),
    "a per-replica field": (
        "replica: {work_dir: /tmp/x}",
        "replica.work_dir is set by the pool for each replica: leave it out",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_MISTAKES))
def test_a_config_mistake_is_one_line_naming_the_file_and_the_key_exit_2(
    case: str, tmp_path: Path
) -> None:
    text, expected = CONFIG_MISTAKES[case]
    config = tmp_path / "pool.yaml"
    config.write_text(text + "\n")
    result = CliRunner().invoke(cli, ["up", "--config", str(config)])
    assert result.exit_code == ExitCode.USAGE, result.output
    line = one_error_line(result)
    assert line.startswith(f"Error: invalid config {config}: "), line
    assert expected in line, line


def test_every_mistake_of_a_config_is_on_its_one_line(tmp_path: Path) -> None:
    config = tmp_path / "pool.yaml"
    config.write_text("router: {api_keys: [k1], port: 1}\ncolour: blue\n")
    result = CliRunner().invoke(cli, ["up", "--config", str(config)])
    line = one_error_line(result)
    assert result.exit_code == ExitCode.USAGE
    assert "router.api_keys belongs at the top level, as api_keys" in line
    assert "router.port belongs at the top level, as router_port" in line
    assert "unknown key colour" in line


def test_a_bad_value_from_the_environment_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUTPOOL_ROUTER_MAX_STALENESS", "soon")
    config = tmp_path / "pool.yaml"
    config.write_text("replicas: 1\n")
    result = CliRunner().invoke(cli, ["up", "--config", str(config)])
    assert result.exit_code == ExitCode.USAGE
    assert "ROLLOUTPOOL_ROUTER_MAX_STALENESS (from the environment): Input should be a valid " in (
        one_error_line(result)
    )


# ---------------------------------------------------------------------------------- fixtures


def model_dir(path: Path, shape: tuple[int, int] = (2, 2)) -> Path:
    path.mkdir()
    save_file({"w": np.zeros(shape, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


@dataclass
class Pool:
    updater: Updater
    updater_url: str
    router_url: str
    checkpoint: Path
    probe: Path
    answered: asyncio.Event  # the updater answered a POST /v1/updates

    async def play_worker(self, *steps: Callable[[UpdateRecord], None]) -> UpdateRecord:
        """Act as the update worker: take the pushed update and, once the push has its answer,
        apply ``steps`` to its record, saving it after each (as the updater does); the last
        step must end it."""
        update = await self.updater.pending.take()
        await self.answered.wait()
        for step in steps:
            step(update.record)
            await self.updater.store.save_update(update.record)
            await asyncio.sleep(0.05)
        self.updater.pending.finish(update)
        return update.record


@pytest.fixture
async def pool(
    tmp_path: Path, store_settings: StoreSettings, store: RedisStore
) -> AsyncIterator[Pool]:
    model = model_dir(tmp_path / "model")
    checkpoint = tmp_path / "step-1"
    shutil.copytree(model, checkpoint)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "expected_token_ids": [8]}))
    replica = ReplicaConfig(id="r0", url=f"http://127.0.0.1:{refused_port()}", model=model)
    settings = UpdaterSettings(admin_token=TOKEN, replicas=[replica])
    updater_store = RedisStore.connect(store_settings)
    updater = Updater(settings, updater_store)
    app = create_api(updater, settings)
    answered = asyncio.Event()

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if request.method == "POST":
            answered.set()

    app.on_response_prepare.append(on_prepare)
    runner, port = await start_server(app, "127.0.0.1", 0)
    # g0 is declared and published, so a push makes g1
    seed = store.updater_lease("seed")
    identity = WeightIdentity(manifest_digest=read_manifest(model).digest, checkpoint_uri="/m")
    await store.declare_generation(
        GenerationRecord(generation=G0, identity=identity, checkpoint="/m"), await seed.acquire()
    )
    await seed.release()
    await publish_ready(store, [("r0", replica.url or "")])
    router: RunningRouter = await serve_router(
        RouterSettings(port=0, api_keys=[KEY], admin_token=TOKEN), store_settings
    )
    try:
        yield Pool(updater, f"http://127.0.0.1:{port}", router.url, checkpoint, probe, answered)
    finally:
        await router.stop()
        await runner.cleanup()
        await updater_store.close()


def push_args(pool: Pool, *extra: str) -> list[str]:
    return [
        "push",
        str(pool.checkpoint),
        "--updater",
        pool.updater_url,
        "--token",
        TOKEN,
        "--probe",
        str(pool.probe),
        *extra,
    ]


async def push(pool: Pool, args: list[str], *steps: Callable[[UpdateRecord], None]) -> Result:
    """Run ``rolloutpool push`` (in a thread) while the test plays the worker with ``steps``."""
    run = asyncio.to_thread(invoke, args)
    if not steps:
        return await run
    result, _ = await asyncio.gather(run, pool.play_worker(*steps))
    return result


# ---------------------------------------------------------------------------------- records


def running(rec: UpdateRecord) -> None:
    rec.state, rec.started_ms = UpdateState.RUNNING, rec.created_ms + 5


def phase(name: str, previous: str | None = None, seconds: float = 0.0) -> Callable[..., None]:
    def step(rec: UpdateRecord) -> None:
        report = rec.replicas.get("r0") or ReplicaReport(replica="r0", generation=rec.generation)
        if previous is not None:
            report.phases = {**report.phases, previous: seconds}
        report.phase = name
        rec.replicas = {**rec.replicas, "r0": report}

    return step


def replica_ready(rec: UpdateRecord) -> None:
    report = rec.replicas["r0"]
    report.phases = {**report.phases, "resume": 0.02}
    report.phase, report.outcome, report.window_s = None, ReplicaOutcome.READY, 1.25
    rec.replicas = {**rec.replicas, "r0": report}


def succeeded(rec: UpdateRecord) -> None:
    rec.state, rec.finished_ms = UpdateState.SUCCEEDED, rec.created_ms + 2000
    rec.rolled_ms, rec.staleness_window_s = rec.created_ms + 1900, 1.9


def tainted(rec: UpdateRecord) -> None:
    report = rec.replicas["r0"]
    report.phases = {**report.phases, "transfer": 3.0}
    report.phase, report.outcome = None, ReplicaOutcome.TAINTED
    report.reason = "transfer deadline 3.0s exceeded"
    rec.replicas = {**rec.replicas, "r0": report}
    rec.state, rec.finished_ms = UpdateState.FAILED, rec.created_ms + 4000
    rec.error = "r0: tainted: transfer deadline 3.0s exceeded"


def superseded(rec: UpdateRecord) -> None:
    rec.state, rec.finished_ms = UpdateState.SUPERSEDED, rec.created_ms + 10
    rec.error = "superseded by g2"


CYCLE = (
    running,
    phase("preflight"),
    phase("drain", "preflight", 0.01),
    phase("pause", "drain", 0.2),
    phase("transfer", "pause", 0.0),
    phase("invalidate", "transfer", 0.91),
    phase("validate", "invalidate", 0.01),
    phase("resume", "validate", 0.31),
    replica_ready,
    succeeded,
)


# ---------------------------------------------------------------------------------- push


async def test_push_piped_prints_one_line_per_phase_change_and_exits_0(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--step", "7"), *CYCLE)
    assert r.exit_code == 0, r.output
    lines = [re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", x) for x in r.stdout.splitlines()]
    uid = lines[0].split()[1]
    assert lines == [
        f"update {uid} queued: generation 1 (g1)",
        f"update {uid} running: generation 1 (g1)",
        "r0           preflight",
        "r0           drain      (preflight 0.01s)",
        "r0           pause      (drain 0.20s)",
        "r0           transfer   (pause 0.00s)",
        "r0           invalidate (transfer 0.91s)",
        "r0           validate   (invalidate 0.01s)",
        "r0           resume     (validate 0.31s)",
        "r0           READY on generation 1 (resume 0.02s; update window 1.25s)",
        f"update {uid} succeeded: generation 1 (g1) is served by every replica in service "
        "(staleness window 1.90s)",
    ]
    assert r.stderr == ""


async def test_push_json_prints_only_the_final_record(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--json"), *CYCLE)
    assert r.exit_code == 0, r.output
    (line,) = r.stdout.splitlines()
    rec = UpdateRecord.model_validate_json(line)
    assert rec.state is UpdateState.SUCCEEDED and rec.replicas["r0"].window_s == 1.25


async def test_push_jsonl_prints_a_record_per_change_and_the_final_one_last(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--progress", "jsonl"), *CYCLE)
    assert r.exit_code == 0, r.output
    records = [UpdateRecord.model_validate_json(x) for x in r.stdout.splitlines()]
    assert records[0].state is UpdateState.QUEUED
    assert [x.state.final for x in records] == [False] * (len(records) - 1) + [True]
    assert records[-1].state is UpdateState.SUCCEEDED
    assert len({x.model_dump_json() for x in records}) == len(records)  # only changes


@pytest.mark.parametrize("columns", [120, 70])
async def test_push_live_redraws_a_table_per_replica(pool: Pool, columns: int) -> None:
    """``--progress live`` is what a terminal gets; on a narrow one the two brief phases go."""
    args = push_args(pool, "--progress", "live")
    run = asyncio.to_thread(CliRunner(env={"COLUMNS": str(columns)}).invoke, cli, args)
    r, _ = await asyncio.gather(run, pool.play_worker(*CYCLE))
    assert r.exit_code == 0, r.output
    assert "\x1b[" in r.stdout  # cursor movement: redrawn in place
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r.stdout)
    assert max(len(x) for x in plain.splitlines()) <= columns
    header = [x.split() for x in plain.splitlines() if x.split()[:2] == ["replica", "now"]][-1]
    row = [x.split() for x in plain.splitlines() if x.startswith("r0 ")][-1]
    if columns == 120:
        assert header[2:] == [*progress.PHASES, "window"]
        times = ["0.01s", "0.20s", "0.00s", "0.91s", "0.01s", "0.31s", "0.02s", "1.25s"]
    else:
        assert header[2:] == ["drain", "transfer", "invalidate", "validate", "resume", "window"]
        times = ["0.20s", "0.91s", "0.01s", "0.31s", "0.02s", "1.25s"]
    assert row == ["r0", "READY", *times]
    assert " ".join(plain.split()).endswith("(staleness window 1.90s)")


async def test_a_failed_update_exits_1_with_its_reason(pool: Pool) -> None:
    r = await push(pool, push_args(pool), running, phase("transfer"), tainted)
    assert r.exit_code == ExitCode.FAILED == 1
    assert "r0           TAINTED (transfer 3.00s): transfer deadline 3.0s exceeded" in r.stdout
    assert one_error_line(r).endswith("failed: r0: tainted: transfer deadline 3.0s exceeded")


async def test_a_superseded_update_exits_1(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--json"), superseded)
    assert r.exit_code == ExitCode.FAILED
    assert UpdateRecord.model_validate_json(r.stdout).state is UpdateState.SUPERSEDED
    assert "superseded: superseded by g2" in one_error_line(r)


async def test_an_update_still_running_at_the_timeout_exits_6(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--timeout", "0.3"))  # nobody takes it: stays queued
    assert r.exit_code == ExitCode.TIMEOUT == 6
    assert "goes on in the updater" in one_error_line(r)


async def test_no_wait_prints_the_queued_update(pool: Pool) -> None:
    r = await push(pool, push_args(pool, "--no-wait"))
    assert r.exit_code == 0
    assert re.fullmatch(r"update up-\w+ queued: generation 1 \(g1\)\n", r.stdout)


async def test_a_wrong_or_missing_token_exits_5(pool: Pool) -> None:
    args = push_args(pool)
    wrong = await asyncio.to_thread(invoke, [*args[:5], "not-the-token", *args[6:]])
    assert wrong.exit_code == ExitCode.AUTH == 5
    assert "refused the token: 403" in one_error_line(wrong)
    missing = await asyncio.to_thread(invoke, [*args[:4], *args[6:]])
    assert missing.exit_code == ExitCode.AUTH
    assert "ROLLOUTPOOL_ADMIN_TOKEN" in one_error_line(missing)
    assert await pool.updater.list(10) == []  # nothing was pushed


async def test_an_unreachable_updater_exits_4(pool: Pool) -> None:
    args = push_args(pool)
    args[3] = f"http://127.0.0.1:{refused_port()}"
    r = await asyncio.to_thread(invoke, args)
    assert r.exit_code == ExitCode.UNREACHABLE == 4
    assert "cannot reach the updater at http://127.0.0.1:" in one_error_line(r)


async def test_a_refused_checkpoint_exits_3(pool: Pool, tmp_path: Path) -> None:
    args = push_args(pool)
    args[1] = str(model_dir(tmp_path / "wrong-shapes", shape=(3, 2)))
    r = await asyncio.to_thread(invoke, args)
    assert r.exit_code == ExitCode.REFUSED == 3
    assert "the updater refused the checkpoint: 422" in one_error_line(r)
    args[1] = str(tmp_path / "missing")
    r = await asyncio.to_thread(invoke, args)
    assert r.exit_code == ExitCode.REFUSED
    assert "is not a directory" in one_error_line(r)
    assert await pool.updater.list(10) == []


async def test_a_bad_probe_file_is_a_usage_error(pool: Pool) -> None:
    pool.probe.write_text('{"prompt_token_ids": [1]}')
    r = await asyncio.to_thread(invoke, push_args(pool))
    assert r.exit_code == ExitCode.USAGE == 2
    assert "expected_token_ids" in one_error_line(r)


# ---------------------------------------------------------------------------------- status


def status_args(pool: Pool, *extra: str) -> list[str]:
    return ["status", "--router", pool.router_url, "--updater", pool.updater_url, *extra]


async def test_status_needs_an_api_key_when_the_router_has_keys(pool: Pool) -> None:
    r = await asyncio.to_thread(invoke, status_args(pool))
    assert r.exit_code == ExitCode.AUTH
    assert "--api-key" in one_error_line(r)
    wrong = await asyncio.to_thread(invoke, status_args(pool, "--api-key", "nope"))
    assert wrong.exit_code == ExitCode.AUTH
    watching = await asyncio.to_thread(invoke, status_args(pool, "--watch", "0.2"))
    assert watching.exit_code == ExitCode.AUTH  # a refused key ends a watch at once


async def test_status_shows_the_published_generation_and_each_replica(pool: Pool) -> None:
    r = await asyncio.to_thread(invoke, status_args(pool, "--api-key", KEY))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1].startswith("published    generation 0 (g0)")
    header = next(x for x in lines if x.startswith("replica "))
    assert header.split() == ["replica", "state", "gen", "label", "active", "capacity"]
    assert lines[lines.index(header) + 1].split() == ["r0", "READY", "0", "g0", "0", "64"]
    assert lines[-1].startswith("last update  not shown: the updater's records need the admin")


async def test_status_with_the_token_shows_the_last_update(pool: Pool) -> None:
    await push(pool, push_args(pool), *CYCLE)
    r = await asyncio.to_thread(invoke, status_args(pool, "--token", TOKEN))  # no API key
    assert r.exit_code == 0, r.output
    last = r.stdout[r.stdout.index("last update") :].splitlines()
    assert re.match(
        r"last update  up-\w+: generation 1 \(g1\) succeeded .+ ago, after 2.00s", last[0]
    )
    assert "(staleness window 1.90s)" in last[0]
    assert last[1].split() == ["r0", "ready,", "update", "window", "1.25s"]
    data = json.loads(
        (await asyncio.to_thread(invoke, status_args(pool, "--token", TOKEN, "--json"))).stdout
    )
    assert data["pool"]["latest"]["generation"] == 0
    assert data["last_update"]["state"] == "succeeded" and data["last_update_note"] is None


async def test_status_says_when_the_last_update_is_not_available(pool: Pool) -> None:
    args = status_args(pool, "--token", TOKEN)
    args[4] = f"http://127.0.0.1:{refused_port()}"
    r = await asyncio.to_thread(invoke, args)
    assert r.exit_code == 0
    assert "last update  unavailable: cannot reach the updater at http://127.0.0.1:" in r.stdout


async def test_status_of_an_unreachable_router_exits_4(pool: Pool) -> None:
    r = await asyncio.to_thread(
        invoke, ["status", "--router", f"http://127.0.0.1:{refused_port()}/v1"]
    )
    assert r.exit_code == ExitCode.UNREACHABLE
    assert "cannot reach the router at http://127.0.0.1:" in one_error_line(r)


def test_status_watch_ends_on_a_ctrl_c_that_lands_in_a_finalizer() -> None:
    """Pins the flaky CLI integration test: a Ctrl-C delivered while Python runs a finalizer
    (here ``__del__``; in the field, an HTTP connection being closed) raised KeyboardInterrupt
    there, which Python prints and drops, so ``status --watch`` went on refreshing."""
    calls = 0

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)

    def read() -> tuple[str, dict[str, Any]]:
        nonlocal calls
        calls += 1
        if calls == 2:
            Finalized()  # dropped at once: the interrupt arrives inside its finalizer
        if calls > 5:
            raise AssertionError("the watch outlived Ctrl-C")
        return "pool", {}

    status._watch(read, 0.01, json_out=True)
    assert calls == 2
