"""The peer routers :mod:`bench.router_vs_peer` compares against, as processes of this machine.

* ``vllm-router`` 0.1.17 (``python -m vllm_router.launch_router --policy round_robin``);
* SMG, the SGLang model gateway (``smg launch --worker-urls ... --policy round_robin``).

Both are installed from PyPI into a venv of their own under ``/tmp`` (never into the project's
venv), with py-spy for the profile. A peer that cannot be installed or started is left out of
the run, and :func:`ensure_tools` / the caller record the exact reason.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pool.launcher import free_port

TOOLS_VENV = Path("/tmp/rolloutpool-peers")
PEERS = {"vllm_router": ("vllm-router", "0.1.17"), "smg": ("smg", None)}


@dataclass
class Tools:
    """The tools venv: its python, and per peer its version or why it is missing."""

    python: Path
    versions: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def pyspy(self) -> Path:
        return self.python.parent / "py-spy"


def _version(py: Path, dist: str) -> str | None:
    probe = f"import importlib.metadata as m; print(m.version('{dist}'))"
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_tools(venv: Path) -> Tools:
    """The venv with each peer and py-spy, installed where missing (one pip call each, so one
    that fails leaves the others); a peer that failed is in ``missing`` with pip's last lines."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([str(py), "-m", "ensurepip"], check=True, capture_output=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    tools = Tools(py)
    for name, (dist, pin) in PEERS.items():
        have = _version(py, dist)
        if have is None or (pin is not None and have != pin):
            print(f"installing {dist} into {venv}", flush=True)
            r = subprocess.run(
                [*pip, f"{dist}=={pin}" if pin else dist], capture_output=True, text=True
            )
            if r.returncode != 0:
                tools.missing[name] = f"pip install {dist} failed: {r.stderr.strip()[-400:]}"
                continue
            have = _version(py, dist)
        if have is None:
            tools.missing[name] = f"{dist} installed but its version cannot be read"
        else:
            tools.versions[name] = have
    if not tools.pyspy.exists():
        subprocess.run([*pip, "py-spy"], check=True)
    return tools


@dataclass
class Server:
    name: str
    proc: asyncio.subprocess.Process
    url: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def wait_ready(url: str, proc: asyncio.subprocess.Process, timeout_s: float = 120) -> None:
    """Until ``GET url`` answers 200 (the process must stay alive); on failure the process is
    killed before this raises, so nothing outlives a failed start."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline and proc.returncode is None:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    raise RuntimeError(f"{url} did not become ready (exit code {proc.returncode})")


async def spawn(work: Path, name: str, argv: list[str], env: dict[str, str]) -> Any:
    log = await asyncio.to_thread((work / f"{name}.log").open, "wb")
    return await asyncio.create_subprocess_exec(*argv, env=env, stdout=log, stderr=log)


async def start_peer(work: Path, python: Path, upstreams: list[str], name: str) -> Server:
    """``vllm-router --policy round_robin`` in front of ``upstreams``; ready when it routes."""
    port = free_port()
    argv = [
        str(python),
        "-m",
        "vllm_router.launch_router",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "round_robin",
        "--log-level", "warning",
        "--prometheus-port", str(free_port()),  # its default is fixed: one per instance
        "--worker-urls", *upstreams,
    ]  # fmt: skip
    proc = await spawn(work, name, argv, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url + "/health", proc)
    return Server("vllm_router", proc, url)


async def start_smg(work: Path, python: Path, upstreams: list[str], name: str) -> Server:
    """``smg launch --policy round_robin`` in front of ``upstreams``; ready when its
    ``/readiness`` is 200 (its workers health-checked)."""
    port = free_port()
    argv = [
        str(python.parent / "smg"),
        "launch",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--policy", "round_robin",
        "--log-level", "warn",
        "--prometheus-port", str(free_port()),
        "--worker-urls", *upstreams,
    ]  # fmt: skip
    proc = await spawn(work, name, argv, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    await wait_ready(url + "/readiness", proc)
    return Server("smg", proc, url)


STARTERS = {"vllm_router": start_peer, "smg": start_smg}
