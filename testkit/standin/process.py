"""A stand-in replica as a child process, for benchmarks that measure what sits in front of it.

:class:`StandinProcess` runs ``python -m testkit.standin --count 1`` on a free port, with the
instant time model (no rates: a request completes the moment it is scheduled, no artificial
delay anywhere) and one SSE event per token (``--stream-per-token``), and stops it. A child
process, so its CPU time can be read from ``/proc/<pid>/stat`` apart from the caller's; on
uvloop when uvloop is installed (vLLM installs it), so that it is not the bottleneck.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

from pool.launcher import free_port

__all__ = ["STANDIN_MODEL", "StandinProcess", "new_event_loop"]

#: the model name a :class:`StandinProcess` serves unless told otherwise
STANDIN_MODEL = "/standin/model"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed, else asyncio's (the stand-in's and benchmark clients')."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class StandinProcess:
    """One instant stand-in replica serving ``model_name``; ``start()`` blocks until it answers.

    The checkpoint is the tiny random model (built and cached on first use).
    """

    def __init__(self, port: int = 0, model_name: str = STANDIN_MODEL) -> None:
        self.port = port or free_port()
        self.model_name = model_name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> StandinProcess:
        argv = [sys.executable, "-m", "testkit.standin", "--count", "1"]
        argv += ["--base-port", str(self.port), "--served-model-name", self.model_name]
        argv += ["--stream-per-token", "--uvloop"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the stand-in did not start on port {self.port}")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> StandinProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
