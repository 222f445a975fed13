"""Start and stop local vLLM replicas (one OS process group each).

:class:`ReplicaSpec` says what to run; :meth:`ReplicaSpec.command` turns it into an argv and an
environment without side effects (pure, unit-testable). :class:`LocalReplica` runs it:

* ``await start()`` spawns the server in its own session/process group (so the API server,
  EngineCore and worker processes can be signalled together), logs stdout+stderr to
  ``<work_dir>/server.log``, then polls ``GET /health`` **and** one tiny greedy completion
  (``max_tokens=1``) until both succeed or a startup deadline passes: ``startup_timeout_s``
  counts only while the process group makes no progress (no CPU time, no wait for a CPU, no
  log output for ``startup_stall_s``), so a start slowed or starved by a saturated host is not
  killed halfway and begun again; ``startup_max_s`` bounds every start. ``/health`` alone is not
  trusted: it answers 200 before the engine has run a request, and some engines die on their
  first one (the eager-bf16 SIGILL in ``reference/vllm-cpu.md`` §8). On any failure the process
  group is killed and :class:`LaunchError` is raised with the exit code and the log's tail;
  nothing is left running. A start that misses its deadline is first sent SIGABRT, so the log
  ends with every process's Python stacks (``PYTHONFAULTHANDLER=1`` is in the environment).
* ``await stop()`` sends SIGTERM to the whole group, waits up to a grace period, then SIGKILLs
  the group. Idempotent; safe on a replica that never started or already died.
* ``kill(sig)`` signals the group without waiting (tests use it to simulate a crash).

Two flavours share one spec: ``cpu`` runs ``python -m vllm.entrypoints.launchers.api_server.entry
--model ...`` (the ``vllm`` console script of ``vllm-cpu`` is broken: its package metadata is
named ``vllm-cpu``); ``gpu`` runs ``python -m vllm.entrypoints.cli.main serve MODEL ...`` and may
add ``--weight-transfer-config '{"backend": "nccl"}'``. Only the CPU flavour is exercised here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pool.errors import RolloutPoolError
from pool.paths import default_cache_root
from pool.ports import free_port
from pool.procgroup import (
    StartupProgress,
    parse_cpus,
    thread_affinity,
    widen_affinity,
)

__all__ = [
    "LaunchError",
    "LocalReplica",
    "ReplicaSpec",
    "count_launches",
    "free_port",
    "log_tail",
]

MIB = 1024 * 1024

#: Unix socket paths are limited to 107 bytes; vLLM puts ``<base>/<uuid4>`` ZMQ sockets under
#: ``VLLM_RPC_BASE_PATH``, so the base must stay well below that.
_MAX_RPC_BASE_LEN = 64
LAUNCH_MARK = "rolloutpool launch:"  # in the line each spawn writes to the server log


class LaunchError(RolloutPoolError):
    """A replica did not become ready. ``context`` has ``exit_code`` and ``log_tail``.

    When this is raised the replica's process group has already been killed.
    """

    code = "launch_error"


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file ("" if it does not exist)."""
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return ""


def count_launches(log_path: Path) -> int:
    """How many times a server was spawned with its output in ``log_path`` (0 if none)."""
    try:
        with log_path.open("r", errors="replace") as f:
            return sum(1 for line in f if line.startswith("=== ") and LAUNCH_MARK in line)
    except FileNotFoundError:
        return 0


class ReplicaSpec(BaseModel):
    """What to launch. Frozen; ``model`` is resolved to an absolute path.

    ``cpu_bind`` becomes ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` or ``"0-1"``; ``None``
    lets vLLM choose, which puts every replica on core 0). ``kv_cache_bytes`` becomes
    ``--kv-cache-memory-bytes`` and an inherited ``VLLM_CPU_KVCACHE_SPACE`` is removed, because
    that variable overrides the flag. ``work_dir`` holds the log, ``VLLM_CACHE_ROOT`` and
    ``TMPDIR``; ``None`` picks a fresh directory under ``<cache>/replicas`` (the cache directory,
    :func:`pool.paths.default_cache_root`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    flavor: Literal["cpu", "gpu"] = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)  # 0: pick a free port at start
    name: str = "replica"
    served_model_name: str | None = None
    cpu_bind: str | None = "0"
    cuda_visible_devices: str | None = None  # gpu flavour only
    kv_cache_bytes: int | None = Field(default=64 * MIB, gt=0)
    enforce_eager: bool = True
    dtype: str = "float32"
    max_model_len: int = Field(default=512, gt=0)
    enable_prefix_caching: bool = True
    enable_scale_out: bool = False  # adds /inference/v1/generate (per-token weight_versions)
    weight_transfer_backend: str | None = None  # gpu: e.g. "nccl" -> --weight-transfer-config
    #: LoRA generations (pool.adapters): adapters one batch may use (``--max-loras``; None: no
    #: LoRA); with it, ``--enable-lora`` and runtime loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    max_loras: int | None = Field(default=None, ge=1)
    #: With ``max_loras``: the highest adapter rank served (``--max-lora-rank``).
    max_lora_rank: int = Field(default=16, ge=1)
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    work_dir: Path | None = None
    #: The start fails once it is older than ``startup_timeout_s`` *and* its process group has
    #: made no progress (CPU time, run-queue wait or log output, see :class:`StartupProgress`) for
    #: ``startup_stall_s``, or in any case once it is older than ``startup_max_s``. A start that
    #: is slow because the host is saturated keeps going; one that hangs is killed.
    startup_timeout_s: float = Field(default=240.0, gt=0)
    startup_stall_s: float = Field(default=60.0, gt=0)
    startup_max_s: float = Field(default=900.0, gt=0)
    stop_grace_s: float = Field(default=20.0, ge=0)

    @model_validator(mode="after")
    def _deadlines_ordered(self) -> ReplicaSpec:
        if self.startup_max_s < self.startup_timeout_s:
            raise ValueError(
                f"startup_max_s ({self.startup_max_s:g}) is shorter than startup_timeout_s "
                f"({self.startup_timeout_s:g})"
            )
        return self

    @field_validator("model")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @property
    def model_name(self) -> str:
        """The name requests must use in ``"model"`` (vLLM defaults it to the model path)."""
        return self.served_model_name or str(self.model)

    def command(self, port: int, work_dir: Path, rpc_dir: Path) -> tuple[list[str], dict[str, str]]:
        """The argv and the full environment for a server on ``port``. No side effects."""
        common = ["--host", self.host, "--port", str(port)]
        common += ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        if self.kv_cache_bytes is not None:
            common += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if self.enforce_eager:
            common.append("--enforce-eager")
        if self.enable_prefix_caching:
            common.append("--enable-prefix-caching")
        if self.enable_scale_out:
            common.append("--enable-scale-out")
        if self.served_model_name:
            common += ["--served-model-name", self.served_model_name]
        if self.max_loras is not None:
            common += ["--enable-lora", "--max-loras", str(self.max_loras)]
            common += ["--max-lora-rank", str(self.max_lora_rank)]
        if self.flavor == "cpu":
            argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
            argv += ["--model", str(self.model), *common]
        else:
            argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(self.model)]
            argv += common
            if self.weight_transfer_backend:
                cfg = json.dumps({"backend": self.weight_transfer_backend})
                argv += ["--weight-transfer-config", cfg]
        argv += list(self.extra_args)

        env = dict(os.environ)
        if self.kv_cache_bytes is not None:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CACHE_ROOT": str(work_dir / "vllm-cache"),
                "TMPDIR": str(work_dir / "tmp"),
                "VLLM_RPC_BASE_PATH": str(rpc_dir),
                "PYTHONUNBUFFERED": "1",
                # a start that misses its deadline gets SIGABRT first: every process of the
                # group then writes its Python stacks to the log (see LocalReplica.start)
                "PYTHONFAULTHANDLER": "1",
            }
        )
        if self.max_loras is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if self.flavor == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind or "auto"
        elif self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        env.update(self.env)
        return argv, env


def _default_work_dir(name: str) -> Path:
    root = default_cache_root() / "replicas"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))


class LocalReplica:
    """One local vLLM server process group, started and stopped by this object.

    Not thread-safe; use from one event loop. ``url``, ``pid`` and ``log_path`` are valid after
    :meth:`start` has spawned the process (``url`` as soon as the port is chosen).
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.port = spec.port or free_port(spec.host)
        self.work_dir = (spec.work_dir or _default_work_dir(spec.name)).resolve()
        self.log_path = self.work_dir / "server.log"
        self._rpc_dir: Path | None = None
        self._own_rpc_dir = False
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._confined_to: set[int] | None = None  # the start's CPU mask, until it is ready
        #: set once :meth:`spawn` has started the current process (cleared by :meth:`restart`)
        self.spawned = asyncio.Event()

    # -- properties ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the group leader has exited (negative: killed by that signal)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    # -- lifecycle ----------------------------------------------------------------------------

    def _prepare_dirs(self) -> Path:
        (self.work_dir / "tmp").mkdir(parents=True, exist_ok=True)
        (self.work_dir / "vllm-cache").mkdir(parents=True, exist_ok=True)
        rpc = self.work_dir / "tmp"
        if len(str(rpc)) > _MAX_RPC_BASE_LEN:
            rpc = Path(tempfile.mkdtemp(prefix="rp-"))
            self._own_rpc_dir = True
        self._rpc_dir = rpc
        return rpc

    def spawn(self) -> None:
        """Spawn the server process (own session) and return at once; does not wait for ready."""
        if self._proc is not None:
            raise LaunchError(f"{self.spec.name} was already started", pid=self.pid)
        rpc_dir = self._prepare_dirs()
        argv, env = self.spec.command(self.port, self.work_dir, rpc_dir)
        # Start confined to the replica's own cores (its processes inherit the mask): torch's
        # MKL counts cores at import by pinning the importing thread to each allowed CPU in
        # turn, and a thread moved onto a CPU saturated by another replica's pinned worker was
        # seen to wait there for minutes (stuck in sched_setaffinity, never scheduled). The
        # mask is widened again once the server is ready (:func:`widen_affinity`). The child
        # inherits the mask of the thread that forks it, so this thread holds the mask for the
        # fork: set on the child afterwards, the child could run unconfined first.
        self._confined_to = self._startup_cpus()
        with self.log_path.open("ab") as log, thread_affinity(self._confined_to):
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log.write(f"=== {stamp} {LAUNCH_MARK} {' '.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.work_dir,
                start_new_session=True,
            )
        self.spawned.set()

    async def start(self) -> float:
        """Spawn the server and wait until it serves a real completion; returns seconds taken.

        Blocks until ready or a deadline (see ``ReplicaSpec.startup_timeout_s``): past
        ``startup_timeout_s`` only while the group still makes progress, never past
        ``startup_max_s``. Raises :class:`LaunchError` (with exit code and log tail) if the
        process exits, a deadline passes (then the group is first sent SIGABRT so the log ends
        with its Python stacks), or the probe completion fails; the process group is killed
        before raising.
        """
        spec = self.spec
        t0 = time.monotonic()
        self.spawn()
        assert self._proc is not None
        # progress: 0.5 s of CPU (at most 5% of one core) used within the stall window
        min_cpu_s = min(0.5, spec.startup_stall_s * 0.05)
        progress = StartupProgress(self._proc.pid, self.log_path, t0, min_cpu_s)
        deadline = t0 + spec.startup_max_s
        next_sample = t0
        phase = "health"
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=10.0) as client:
                while True:
                    if not self.alive:
                        await self._fail(f"server exited during startup ({phase} phase)")
                    now = time.monotonic()
                    if now >= next_sample:
                        progress.sample(now)
                        next_sample = now + min(5.0, spec.startup_stall_s / 4)
                    why = None
                    if now >= deadline:
                        why = f"not ready after {spec.startup_max_s:.0f}s (startup_max_s)"
                    elif (
                        now - t0 >= spec.startup_timeout_s
                        and (stalled := progress.stalled_for(now)) >= spec.startup_stall_s
                    ):
                        why = (
                            f"not ready after {now - t0:.0f}s and no progress (CPU, run-queue "
                            f"wait or log output) for {stalled:.0f}s; its processes: "
                            f"{progress.describe()}"
                        )
                    if why is not None:
                        await self._dump_stacks()
                        await self._fail(
                            f"{why} ({phase} phase); the log ends with each process's Python stacks"
                        )
                    remaining = deadline - now
                    try:
                        if phase == "health":
                            r = await client.get("/health", timeout=min(5.0, remaining))
                            if r.status_code == 200:
                                phase = "completion"
                        if phase == "completion":
                            await self._probe(client, min(60.0, max(remaining, 0.1)))
                            break
                    except httpx.TransportError:
                        pass  # not listening yet, or the completion timed out: poll again
                    await asyncio.sleep(0.5)
        except BaseException:
            await self._cleanup_after_failure()
            raise
        if self._confined_to is not None:
            widen_affinity(self._proc.pid, os.sched_getaffinity(0))
        self.startup_s = time.monotonic() - t0
        return self.startup_s

    def _startup_cpus(self) -> set[int] | None:
        """The CPU flavour's bind cores, if they are a plain list the launcher may use."""
        if self.spec.flavor != "cpu" or not hasattr(os, "sched_setaffinity"):
            return None
        cpus = parse_cpus(self.spec.cpu_bind)
        if cpus is None or not cpus <= os.sched_getaffinity(0):
            return None
        return cpus

    async def _dump_stacks(self, wait_s: float = 3.0) -> None:
        """SIGABRT the group: with ``PYTHONFAULTHANDLER`` set, each Python process writes all
        its threads' stacks to the log before it dies (where a stuck start was stuck)."""
        self.kill(signal.SIGABRT)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self._proc.wait, wait_s)

    async def _probe(self, client: httpx.AsyncClient, limit_s: float) -> None:
        body: dict[str, Any] = {
            "model": self.spec.model_name,
            "prompt": [0, 300, 301, 302],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        r = await client.post("/v1/completions", json=body, timeout=limit_s)
        if r.status_code != 200:
            await self._fail(f"probe completion answered HTTP {r.status_code}: {r.text[:300]}")
        try:
            choices = r.json()["choices"]
            ok = isinstance(choices, list) and len(choices) == 1
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            await self._fail(f"probe completion returned an unexpected body: {r.text[:300]}")

    async def _fail(self, why: str) -> None:
        """Kill the group, then raise LaunchError with the exit code and the log tail."""
        await self._cleanup_after_failure()
        code = self.returncode
        tail = self.log_tail(40)
        raise LaunchError(
            f"{self.spec.name} on {self.url} failed to start: {why}; exit code {code}; "
            f"log {self.log_path}, last lines:\n{tail}",
            exit_code=code,
            log_path=str(self.log_path),
            log_tail=tail,
            url=self.url,
        )

    async def _cleanup_after_failure(self) -> None:
        with contextlib.suppress(Exception):
            await self.stop(grace_s=5.0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group; no wait. No-op if never started or gone."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    async def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the group, wait up to ``grace_s`` (default ``spec.stop_grace_s``), SIGKILL.

        Returns the leader's exit status (None if never started). Idempotent. After it returns
        no process of the group is left (a final SIGKILL to the group reaps stragglers).
        """
        proc = self._proc
        if proc is None:
            return None
        grace = self.spec.stop_grace_s if grace_s is None else grace_s
        if proc.poll() is None:
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, grace)
        self.kill(signal.SIGKILL)  # stragglers (EngineCore, workers) and an unresponsive leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 30.0)
        if self._own_rpc_dir and self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._own_rpc_dir = False
        return proc.returncode

    async def restart(self) -> float:
        """Stop the process group (if any) and start a fresh server on the same port and work
        dir, so the replica keeps its URL. Returns the start time in seconds (see :meth:`start`)."""
        await self.stop()
        self._proc = None
        self.spawned.clear()
        return await self.start()

    async def __aenter__(self) -> LocalReplica:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
