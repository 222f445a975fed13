"""Start and stop a local ``redis-server``: the store of the embedded default pool
(:mod:`rolloutpool.embedded`), and of tests and benchmarks (:mod:`testkit.redis_server`).

The server runs in its own process group with AOF persistence (``appendfsync everysec``) in a
directory of the caller's choosing, so a restart on the same directory keeps its data.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from pool.errors import RolloutPoolError
from pool.launcher import free_port

__all__ = ["RedisServer", "free_port"]


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1.

    ``start()`` blocks until the server answers PING (or raises with its log tail);
    ``stop()`` is idempotent. ``password`` alone enables ``requirepass``; with ``username`` it
    creates that ACL user (all keys, channels and commands), and the ``default`` user gets a
    random password nobody is given. The ``default`` user is deliberately *not* disabled: on
    Redis 7.0, AOF loading replays MULTI/EXEC blocks (how our Lua scripts' effects are logged)
    through a client that then fails with ``NOPERM``, so every transaction is skipped and the
    data is lost on restart (seen in ``bench/reliability.py``).
    """

    def __init__(
        self,
        workdir: Path,
        port: int = 0,
        password: str | None = None,
        appendonly: bool = True,
        username: str | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.username = username
        self.appendonly = appendonly
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RolloutPoolError("redis-server not found: apt-get install -y redis-server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--logfile", str(self.log_path),
            "--daemonize", "no",
            *self.extra,
        ]  # fmt: skip
        if self.username and self.password:
            argv += [
                "--requirepass",
                secrets.token_hex(24),
                "--user",
                self.username,
                "on",
                f">{self.password}",
                "~*",
                "&*",
                "+@all",
            ]
        elif self.password:
            argv += ["--requirepass", self.password]
        self.proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._ping():
                return self
            time.sleep(0.05)
        tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
        self.stop()
        raise RolloutPoolError(f"redis-server did not start on port {self.port}: {tail}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                if self.password:
                    user = f"{self.username} " if self.username else ""
                    s.sendall(f"AUTH {user}{self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
