"""An instant stand-in for a vLLM server, for measuring a router's own cost.

    python -m testkit.stub_upstream --port 8100

It answers at once, with canned bodies, what a router needs from a replica:

* ``GET /v1/models`` (one model, :data:`STUB_MODEL`), ``GET /version`` (:data:`STUB_VERSION`),
  ``GET /health`` (200, empty: what vLLM answers and what peer routers poll);
* ``POST /v1/completions``: non-streamed, a completion of ``max_tokens`` tokens (default 1) in
  one JSON body; with ``"stream": true``, ``max_tokens`` (default 16, at most
  :data:`MAX_TOKENS`) SSE chunks of one token each, each its own write, the last one with
  ``finish_reason`` "length", then a usage chunk if ``stream_options.include_usage``, then
  ``data: [DONE]``, as vLLM sends them.

Bodies are built once per token count, so the stub's cost per request is aiohttp's alone. It is
not vLLM: no validation beyond "the body is JSON", no chat, no spans (``weight_versions``).
It runs on uvloop when uvloop is installed (vLLM installs it), to keep it from being the
bottleneck of a benchmark.

:class:`StubUpstream` runs it as a child process (so its CPU time can be read from
``/proc/<pid>/stat`` apart from the caller's) and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import subprocess
import sys
import time
import urllib.request
from typing import Any

from aiohttp import web

from pool.launcher import free_port

STUB_MODEL = "/stub/model"
STUB_VERSION = "0.32.0"
MAX_TOKENS = 4096
_JSON = "application/json"


def _completion(n: int) -> dict[str, Any]:
    return {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 0,
        "model": STUB_MODEL,
        "choices": [
            {
                "index": 0,
                "text": " tok" * n,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_token_ids": None,
            }
        ],
        "system_fingerprint": "stub",
        "usage": {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n},
    }


@functools.lru_cache(maxsize=64)
def completion_body(n: int) -> bytes:
    """The non-streamed answer for ``max_tokens = n``."""
    return json.dumps(_completion(n)).encode()


@functools.lru_cache(maxsize=64)
def stream_events(n: int, include_usage: bool) -> tuple[bytes, ...]:
    """The SSE events (each ``data: ...\\n\\n``) of a streamed answer of ``n`` tokens."""

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    head = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": STUB_MODEL}
    events = [
        event(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "text": " tok",
                        "logprobs": None,
                        "finish_reason": "length" if i == n - 1 else None,
                        "stop_reason": None,
                    }
                ],
                "usage": None,
            }
        )
        for i in range(n)
    ]
    if include_usage:
        usage = {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}
        events.append(event({**head, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return tuple(events)


def _tokens(body: dict[str, Any], default: int) -> int:
    n = body.get("max_tokens")
    return max(1, min(n, MAX_TOKENS)) if isinstance(n, int) else default


async def _completions(request: web.Request) -> web.StreamResponse:
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        err = {"error": {"code": 400, "message": "body is not a JSON object"}}
        return web.json_response(err, status=400)
    if body.get("stream") is not True:
        return web.Response(body=completion_body(_tokens(body, 1)), content_type=_JSON)
    options = body.get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    for chunk in stream_events(_tokens(body, 16), usage):
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": STUB_VERSION})


async def _health(request: web.Request) -> web.Response:
    return web.Response()


def create_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/completions", _completions)
    return app


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed, else asyncio's (also used by the benchmark clients)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Serve until SIGTERM/SIGINT (blocks)."""
    web.run_app(
        create_app(), host=host, port=port, print=None, access_log=None, loop=new_event_loop()
    )


class StubUpstream:
    """The stub as a child process on a free port; ``start()`` blocks until it answers."""

    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout_s: float = 30.0) -> StubUpstream:
        argv = [sys.executable, "-m", "testkit.stub_upstream", "--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"stub upstream did not start on port {self.port}")

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

    def __enter__(self) -> StubUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    serve(args.port, args.host)


if __name__ == "__main__":
    main()
