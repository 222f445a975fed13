"""The worker's own lane for ``ipc_direct`` transfers: a Unix socket served by one thread.

A transfer through vLLM's ``/collective_rpc`` crosses the API server, the engine core's utility
call and the executor's message queue to reach the worker and back: a few milliseconds of
fixed cost (measured on an H200, 8B shape: ~4.5 ms for a call with a small answer), against a
copy of ~10 ms. The lane skips them: the worker extension
(:meth:`pool.replica_extension.WeightExtension.rolloutpool_ipc_lane`, itself asked through
``/collective_rpc``) listens on a Unix socket in a directory the sender created, and the sender
asks for the copy there, as one JSON line, answered by one JSON line: the same call, the same
answer (:meth:`~pool.replica_extension.WeightExtension.rolloutpool_ipc_copy`).

**Who can use it**: a process that can reach the socket's path (the same host, a directory
the sender made private: mode 0700) — which a CUDA IPC sender already is. The worker refuses a
directory that is not a private directory of its own user.

**Concurrency**: one connection at a time, one request at a time; the handler runs in the
lane's thread (the extension serialises it with the RPC path). The sender asks only while the
engine is paused (the transport checks), as for the RPC path. A request that fails answers
``{"error": ...}``; the connection stays open. :meth:`IpcLane.close` stops the thread and
removes the socket.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["IpcLane", "private_dir_problem"]

log = logging.getLogger("rolloutpool.ipc_lane")

Handler = Callable[[dict[str, str]], dict[str, Any]]


def private_dir_problem(directory: Path) -> str:
    """Why ``directory`` cannot hold a lane's socket ("" if it can): it must be a directory
    owned by this process's user and reachable by no one else."""
    try:
        st = directory.lstat()
    except OSError as e:
        return f"{directory}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{directory} belongs to uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"{directory} is reachable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


class IpcLane:
    """Serves ``handler`` on a Unix socket at ``path`` (see the module docstring). ``setup``
    runs once in the lane's thread before it serves (e.g. select the worker's CUDA device)."""

    def __init__(self, path: Path, handler: Handler, setup: Callable[[], None]) -> None:
        self.path = path
        self._handler = handler
        self._setup = setup
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.listen(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="rolloutpool-ipc-lane", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        self._setup()
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                with conn, conn.makefile("rwb") as f:
                    for line in f:
                        f.write(self._answer(line) + b"\n")
                        f.flush()
            except OSError as e:  # the sender went away (e.g. its deadline): serve the next
                log.warning("ipc lane connection ended: %s", e)

    def _answer(self, line: bytes) -> bytes:
        try:
            kwargs = json.loads(line)
            if not isinstance(kwargs, dict):
                raise ValueError("a request is a JSON object")
            out = self._handler({str(k): str(v) for k, v in kwargs.items()})
        except Exception as e:  # answered: the sender decides what a failure means
            log.warning("ipc lane request failed: %s", e)
            out = {"error": f"{type(e).__name__}: {e}"[:2000]}
        return json.dumps(out).encode()

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.path.unlink(missing_ok=True)
